"""A ProfilingSource over CUPTI PM sampling that is built on first use.

CUPTI needs NVML's GPU list, and opens the GPU's performance monitors only when the profiling
collector runs, so the sampler is made lazily; a failed build is retried on the next call (the
GPU may appear later). Neither this module nor building the sampler touches CUDA: ``cuInit`` (and
a primary context, only where CUPTI needs one) happens in the sampler's first start, inside
:meth:`LazyProfiling.sample_profiling`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mrc_agent.agent.core.hw.base import DeviceSource, ProfilingSample

if TYPE_CHECKING:
    from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler


class LazyProfiling:
    """Profiling counters for the GPUs ``devices`` reports, sampled every ``interval_s``."""

    def __init__(self, devices: DeviceSource, interval_s: float = 0.1) -> None:
        self._devices = devices
        self._interval_s = interval_s
        self._sampler: CuptiPmSampler | None = None

    def sample_profiling(self) -> list[ProfilingSample]:
        if self._sampler is None:
            # CUPTI takes CUDA device indices; PCI order makes them agree with NVML's. The
            # agent's own environment is the only one it changes (the target's is its own).
            os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
            from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler

            # Physical GPUs only: CUPTI refuses MIG devices (docs/gpu-readings.md).
            self._sampler = CuptiPmSampler([s.gpu for s in self._devices.sample_devices()
                                            if not s.gpu.is_mig],
                                           interval_s=self._interval_s)
        return self._sampler.sample_profiling()

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
