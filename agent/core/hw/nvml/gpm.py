"""GPM (GPU Performance Monitoring, Hopper and newer): support check and activity samples.

GPM metrics are computed between two samples, so each GPU keeps two sample buffers used
alternately (on its :class:`Gpu`, freed at teardown) and its first sample of a session only
primes them. Whether a GPU supports GPM is remembered across sessions by UUID.

GPM runs on its own cadence, not the sampler's: NVML's reference for ``nvmlGpmMetricsGet``
says the two samples "should be greater than 100ms" apart, and a window of a second averages
out the bursts of a decode loop. A call inside the current window takes no new sample and
returns the last window's values again (the same numbers, not a fresh measurement), so a
10 Hz sampler reads GPM once per ``interval`` seconds.

Each metric of a window stands alone: one the GPU does not support is absent (logged once);
one that fails otherwise, or comes back NaN or infinite (NVML can answer SUCCESS with NaN:
DCGM checks ``isnan`` after the same call), is absent for that window only. Only a failure of
the sample itself (``nvmlGpmSampleGet``) or of the whole ``nvmlGpmMetricsGet`` call fails the
sample. Ratios are clamped to 0-1 and rates to >= 0: a percentage a hair over 100 is rounding,
not a finding.

In MIG mode GPM is per GPU instance, not per MIG device: ``nvmlGpmMigSampleGet`` takes the
physical GPU and a GPU instance id, nothing narrower, while a MIG device is one compute
instance of a GPU instance (NVML's ``nvmlDeviceGetMigDeviceHandleByIndex`` enumerates compute
instances). So the compute instances of one GPU instance are sampled once, on one pair of
buffers, and each gets that same window's numbers with :attr:`GpmSample.gpu_instance` set.
The GPM collector exports them once per GPU instance, under the first of its compute instances
the agent reports, and says on ``mrc_gpu_gpm_scope_info`` (``scope="gpu_instance"``) which GPU
instance every MIG device's GPM is; a pod given any one compute instance still sees its GPU
instance's activity, under that one's ``uuid``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

from mrc_agent.agent.core.hw.base import GpmSample, ratio_of_percent
from mrc_agent.agent.core.hw.nvml.session import Gpu, Memo, quietly, unsupported_codes
from mrc_agent.agent.core.hw.nvml.units import gpm_mib_per_s_to_bytes_per_s

log = logging.getLogger(__name__)

#: Seconds between two GPM samples by default.
DEFAULT_GPM_INTERVAL_S = 1.0
#: The shortest window allowed: twice NVML's 100 ms floor, so timer jitter never crosses it.
MIN_GPM_INTERVAL_S = 0.2


def _rate(mib_per_s: float) -> float:
    return max(0.0, gpm_mib_per_s_to_bytes_per_s(mib_per_s))


#: GPM metric id attribute name in pynvml -> GpmSample attribute, and the converter applied.
_GPM_METRICS: tuple[tuple[str, str, Callable[[float], float | None]], ...] = (
    ("NVML_GPM_METRIC_SM_UTIL", "sm_util", ratio_of_percent),
    ("NVML_GPM_METRIC_SM_OCCUPANCY", "sm_occupancy", ratio_of_percent),
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", "tensor_util", ratio_of_percent),
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", "dram_bw_util", ratio_of_percent),
    ("NVML_GPM_METRIC_PCIE_TX_PER_SEC", "pcie_tx_bytes_per_second", _rate),
    ("NVML_GPM_METRIC_PCIE_RX_PER_SEC", "pcie_rx_bytes_per_second", _rate),
    ("NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", "nvlink_tx_bytes_per_second", _rate),
    ("NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", "nvlink_rx_bytes_per_second", _rate),
)


def check_gpm_interval(seconds: float) -> float:
    """``seconds`` if it is a usable GPM window, else ValueError naming the floor."""
    if not (math.isfinite(seconds) and seconds >= MIN_GPM_INTERVAL_S):
        raise ValueError(
            f"GPM interval must be at least {MIN_GPM_INTERVAL_S} s (NVML wants more than "
            f"100 ms between two GPM samples), not {seconds}"
        )
    return seconds


class GpmSampler:
    """Per-GPU GPM support (remembered by UUID) and GPM samples between two buffers.

    ``clock`` (monotonic seconds) times the windows; ``interval`` is their length.
    """

    def __init__(
        self,
        memo: Memo,
        *,
        clock: Callable[[], float],
        interval: float = DEFAULT_GPM_INTERVAL_S,
    ) -> None:
        self._memo = memo
        self._clock = clock
        self._interval = check_gpm_interval(interval)
        self._support: dict[str, bool] = {}
        # (parent UUID, GPU instance id) -> the MIG device whose buffers sample that GPU
        # instance for every compute instance of it (the first one asked).
        self._instance_owner: dict[tuple[str, int], Gpu] = {}

    @property
    def interval(self) -> float:
        return self._interval

    def supported(self, lib: Any, gpu: Gpu) -> bool:
        """Whether the (physical) GPU supports GPM; asked once per GPU, then remembered."""
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
        for key in [k for k, owner in self._instance_owner.items() if owner is gpu]:
            del self._instance_owner[key]

    def _owner(self, gpu: Gpu) -> Gpu:
        """The MIG device that samples ``gpu``'s GPU instance (``gpu`` itself for a whole GPU
        and for the first compute instance of each GPU instance)."""
        if gpu.parent is None or gpu.gpu_instance is None:
            return gpu
        key = (gpu.parent.identity.uuid, gpu.gpu_instance)
        owner = self._instance_owner.get(key)
        if owner is None or owner.parent is not gpu.parent:  # none yet, or an older session's
            owner = self._instance_owner[key] = gpu
        return owner

    def sample(self, lib: Any, gpu: Gpu) -> GpmSample | None:
        """The GPU's GPM metrics over its latest window; None until a window has closed.

        Inside a window the previous window's sample is returned again (a copy). A compute
        instance that shares its GPU instance with an earlier one gets that one's sample, under
        its own identity.
        """
        owner = self._owner(gpu)
        if owner is not gpu:
            shared = self.sample(lib, owner)
            return None if shared is None else replace(shared, gpu=gpu.identity)
        now = self._clock()
        if gpu.gpm_taken_at is not None and now - gpu.gpm_taken_at < self._interval:
            return replace(gpu.gpm_last) if gpu.gpm_last is not None else None
        if not gpu.gpm_buffers:
            gpu.gpm_buffers = [lib.nvmlGpmSampleAlloc(), lib.nvmlGpmSampleAlloc()]
        current = gpu.gpm_buffers[gpu.gpm_next]

        def take() -> Any:
            if gpu.parent is not None:  # a MIG device: its GPU instance, on the physical GPU
                lib.nvmlGpmMigSampleGet(gpu.parent.handle, gpu.gpu_instance, current)
            else:
                lib.nvmlGpmSampleGet(gpu.handle, current)
            return current  # not None: the memo's None means "not supported"

        taken = self._memo.optional(lib, gpu, "gpm", take)
        if taken is None:
            # The device said yes to GPM but will not sample (e.g. MIG mode at device level).
            self._support[gpu.identity.uuid] = False
            return None
        gpu.gpm_taken_at = now
        previous = gpu.gpm_buffers[gpu.gpm_next ^ 1]
        gpu.gpm_next ^= 1
        if not gpu.gpm_primed:
            # GPM metrics are computed between two samples; the first one only sets the start.
            gpu.gpm_primed = True
            return None
        gpu.gpm_last = self._metrics(lib, gpu, previous, current)
        return replace(gpu.gpm_last)

    def _metrics(self, lib: Any, gpu: Gpu, previous: Any, current: Any) -> GpmSample:
        wanted = [(int(getattr(lib, name)), attr, convert) for name, attr, convert in _GPM_METRICS]
        request = lib.c_nvmlGpmMetricsGet_t()
        request.version = lib.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(wanted)
        request.sample1 = previous  # older
        request.sample2 = current  # newer
        for i, (metric_id, _, _) in enumerate(wanted):
            request.metrics[i].metricId = metric_id
        lib.nvmlGpmMetricsGet(request)

        out = GpmSample(gpu=gpu.identity, gpu_instance=gpu.gpu_instance)
        uuid = gpu.identity.uuid
        for i, (metric_id, attr, convert) in enumerate(wanted):
            metric = request.metrics[i]
            code = metric.nvmlReturn
            if code == lib.NVML_SUCCESS:
                value = float(metric.value)
                if math.isfinite(value):
                    setattr(out, attr, convert(value))
                    continue
                why = f"answered {value}"
            elif code in unsupported_codes(lib):
                # E.g. NVLink metrics on a PCIe-only board: absent, not zero.
                self._memo.log_once(
                    log,
                    f"gpm_metric:{uuid}:{metric_id}",
                    logging.INFO,
                    "GPU %d (%s): GPM metric %s not supported; leaving it absent",
                    gpu.index,
                    uuid,
                    attr,
                )
                continue
            else:
                why = f"failed ({lib.NVMLError(code)})"
            # Absent for this window only: one metric's trouble is not the session's.
            self._memo.log_once(
                log,
                f"gpm_metric_window:{uuid}:{metric_id}",
                logging.WARNING,
                "GPU %d (%s): GPM metric %s %s; absent for that window (logged once)",
                gpu.index,
                uuid,
                attr,
                why,
            )
        return out
