"""MIG (Multi-Instance GPU): whether a GPU is partitioned, and its MIG devices.

In MIG mode NVML stops answering some whole-GPU queries (utilisation, utilisation samples,
GPM samples of the whole device) and answers others per MIG device (memory, process lists) or
per GPU instance (GPM through ``nvmlGpmMigSampleGet``). Each MIG device becomes a :class:`Gpu`
of its own, with its ``MIG-…`` UUID (what ``NVIDIA_VISIBLE_DEVICES`` names for a pod given a
slice) and ``parent`` set, so its series are told apart by the ``uuid`` label while ``gpu``
stays the physical GPU's index. Discovered once per NVML session, like the links.

A MIG device is one compute instance of a GPU instance (``nvmlDeviceGetMigDeviceHandleByIndex``
enumerates compute instances), and several may share one GPU instance; ``gpu_instance`` on its
:class:`Gpu` is the GPU instance's id. GPM is that GPU instance's, shared by its compute
instances and said so (``agent.core.hw.nvml.gpm``).

Not available per MIG device, and said so in ``doctor`` and docs/attribution.md: GPU and
memory utilisation and their fine-grained samples (NVML answers NOT_SUPPORTED in MIG mode),
and CUPTI PM sampling (CUPTI refuses MIG devices). Power, clocks, temperature, ECC, PCIe and
NVLink stay device-wide, on the physical GPU's series.
"""

from __future__ import annotations

import logging
from typing import Any

from mrc_agent.agent.core.hw.base import GPUIdentity
from mrc_agent.agent.core.hw.nvml.session import Gpu, Memo, decode_text, unsupported_codes

log = logging.getLogger(__name__)


class MigDevices:
    """Each GPU's MIG devices (none when MIG mode is off or the library has no MIG calls)."""

    def __init__(self, memo: Memo) -> None:
        self._memo = memo

    def enabled(self, lib: Any, gpu: Gpu) -> bool:
        """Whether the GPU is in MIG mode now (the current mode, not a pending one)."""
        if gpu.parent is not None or not hasattr(lib, "nvmlDeviceGetMigMode"):
            return False
        mode = self._memo.optional(lib, gpu, "mig_mode",
                                   lambda: lib.nvmlDeviceGetMigMode(gpu.handle))
        return mode is not None and int(mode[0]) == int(lib.NVML_DEVICE_MIG_ENABLE)

    def devices(self, lib: Any, gpu: Gpu) -> list[Gpu]:
        """The GPU's MIG devices, discovered on the first call of the session."""
        if gpu.mig_devices is None:
            gpu.mig_devices = self._discover(lib, gpu) if self.enabled(lib, gpu) else []
        return gpu.mig_devices

    def _discover(self, lib: Any, gpu: Gpu) -> list[Gpu]:
        count = int(lib.nvmlDeviceGetMaxMigDeviceCount(gpu.handle))
        found: list[Gpu] = []
        stop = unsupported_codes(lib) | {lib.NVML_ERROR_NOT_FOUND, lib.NVML_ERROR_INVALID_ARGUMENT}
        for position in range(count):
            try:
                handle = lib.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, position)
            except lib.NVMLError as err:
                if err.value not in stop:
                    raise
                continue  # an empty slot: MIG devices need not be numbered densely
            instance = int(lib.nvmlDeviceGetGpuInstanceId(handle))
            identity = GPUIdentity(
                index=gpu.index,
                uuid=decode_text(lib.nvmlDeviceGetUUID(handle)),
                name=f"{gpu.identity.name} MIG GI {instance}",
            )
            found.append(Gpu(index=gpu.index, handle=handle, identity=identity, parent=gpu,
                             gpu_instance=instance))
        self._memo.log_once(
            log, f"mig:{gpu.identity.uuid}", logging.INFO,
            "GPU %d (%s): MIG mode, %d MIG device(s) (%s); utilisation and profiling "
            "counters are not available per MIG device", gpu.index, gpu.identity.uuid,
            len(found), ", ".join(d.identity.uuid for d in found) or "none",
        )
        return found
