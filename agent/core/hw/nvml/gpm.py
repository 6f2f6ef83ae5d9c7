"""GPM (GPU Performance Monitoring, Hopper and newer): support check and activity samples.

GPM metrics are computed between two samples, so each GPU keeps two sample buffers used
alternately (on its :class:`Gpu`, freed at teardown) and its first sample of a session only
primes them. Whether a GPU supports GPM is remembered across sessions by UUID.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from mrc_agent.agent.core.hw.base import GpmSample
from mrc_agent.agent.core.hw.nvml.session import Gpu, Memo, quietly, unsupported_codes
from mrc_agent.agent.core.hw.nvml.units import gpm_mib_per_s_to_bytes_per_s, percent_to_ratio

log = logging.getLogger(__name__)

#: GPM metric id attribute name in pynvml -> GpmSample attribute, and the converter applied.
_GPM_METRICS: tuple[tuple[str, str, Callable[[float], float]], ...] = (
    ("NVML_GPM_METRIC_SM_UTIL", "sm_util", percent_to_ratio),
    ("NVML_GPM_METRIC_SM_OCCUPANCY", "sm_occupancy", percent_to_ratio),
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", "tensor_util", percent_to_ratio),
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", "dram_bw_util", percent_to_ratio),
    ("NVML_GPM_METRIC_PCIE_TX_PER_SEC", "pcie_tx_bytes_per_second", gpm_mib_per_s_to_bytes_per_s),
    ("NVML_GPM_METRIC_PCIE_RX_PER_SEC", "pcie_rx_bytes_per_second", gpm_mib_per_s_to_bytes_per_s),
    (
        "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC",
        "nvlink_tx_bytes_per_second",
        gpm_mib_per_s_to_bytes_per_s,
    ),
    (
        "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC",
        "nvlink_rx_bytes_per_second",
        gpm_mib_per_s_to_bytes_per_s,
    ),
)


class GpmSampler:
    """Per-GPU GPM support (remembered by UUID) and GPM samples between two buffers."""

    def __init__(self, memo: Memo) -> None:
        self._memo = memo
        self._support: dict[str, bool] = {}

    def supported(self, lib: Any, gpu: Gpu) -> bool:
        """Whether the GPU supports GPM; asked once per GPU, then remembered."""
        uuid = gpu.identity.uuid
        if uuid not in self._support:
            support = self._memo.optional(
                lib, gpu, "gpm", lambda: lib.nvmlGpmQueryDeviceSupport(gpu.handle)
            )
            supported = bool(support is not None and support.isSupportedDevice)
            self._support[uuid] = supported
            if not supported:
                self._memo.log_once(
                    log, f"gpm:{uuid}", logging.INFO, "GPU %d (%s): no GPM support", gpu.index, uuid
                )
        return self._support[uuid]

    def any_supported(self, gpus: Iterable[Gpu]) -> bool:
        """Whether any of these GPUs is known to support GPM (and sample it)."""
        return any(self._support.get(gpu.identity.uuid) for gpu in gpus)

    def release(self, lib: Any, gpu: Gpu) -> None:
        """Free the GPU's sample buffers at teardown; NVML errors are ignored."""
        for buffer in gpu.gpm_buffers:
            quietly(lib, "freeing a GPM sample", partial(lib.nvmlGpmSampleFree, buffer))

    def sample(self, lib: Any, gpu: Gpu) -> GpmSample | None:
        """The GPU's GPM metrics since its previous call; None on the priming call."""
        if not gpu.gpm_buffers:
            gpu.gpm_buffers = [lib.nvmlGpmSampleAlloc(), lib.nvmlGpmSampleAlloc()]
        current = gpu.gpm_buffers[gpu.gpm_next]

        def take() -> bool:
            lib.nvmlGpmSampleGet(gpu.handle, current)
            return True

        taken = self._memo.optional(lib, gpu, "gpm", take)
        if taken is None:
            # The device said yes to GPM but will not sample (e.g. MIG mode at device level).
            self._support[gpu.identity.uuid] = False
            return None
        previous = gpu.gpm_buffers[gpu.gpm_next ^ 1]
        gpu.gpm_next ^= 1
        if not gpu.gpm_primed:
            # GPM metrics are computed between two samples; the first one only sets the start.
            gpu.gpm_primed = True
            return None

        wanted = [(int(getattr(lib, name)), attr, convert) for name, attr, convert in _GPM_METRICS]
        request = lib.c_nvmlGpmMetricsGet_t()
        request.version = lib.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(wanted)
        request.sample1 = previous  # older
        request.sample2 = current  # newer
        for i, (metric_id, _, _) in enumerate(wanted):
            request.metrics[i].metricId = metric_id
        lib.nvmlGpmMetricsGet(request)

        out = GpmSample(gpu=gpu.identity)
        for i, (metric_id, attr, convert) in enumerate(wanted):
            metric = request.metrics[i]
            if metric.nvmlReturn == lib.NVML_SUCCESS:
                setattr(out, attr, convert(metric.value))
            elif metric.nvmlReturn in unsupported_codes(lib):
                # E.g. NVLink metrics on a PCIe-only board: absent, not zero.
                self._memo.log_once(
                    log,
                    f"gpm_metric:{gpu.identity.uuid}:{metric_id}",
                    logging.INFO,
                    "GPU %d (%s): GPM metric %s not supported; leaving it absent",
                    gpu.index,
                    gpu.identity.uuid,
                    attr,
                )
            else:
                raise lib.NVMLError(metric.nvmlReturn)
        return out
