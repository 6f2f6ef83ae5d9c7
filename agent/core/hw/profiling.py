"""A ProfilingSource over CUPTI PM sampling that is built on first use.

CUPTI needs NVML's GPU list, and opens the GPU's performance monitors only when the profiling
collector runs, so the sampler is made lazily; a failed build is retried on the next call (the
GPU may appear later). Neither this module nor building the sampler touches CUDA: ``cuInit`` (and
a primary context, only where CUPTI needs one) happens in the sampler's first start.

It is a :class:`ScopedProfilingSource`: the profiling collector hands it the pass's attribution
decision, and only the pod's GPUs are profiled (``agent.core.hw.cupti_pm``, "Which GPUs").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mrc_agent.agent.core.hw.base import DeviceSource, ProfilingSample, ScopeOf

if TYPE_CHECKING:
    from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler


class LazyProfiling:
    """Profiling counters for the GPUs ``devices`` reports, sampled every ``interval_s``.
    ``profile_undecided``: profile every GPU of a node of several while no target says which
    are its own (the ``profile_unattributed`` setting)."""

    def __init__(self, devices: DeviceSource, interval_s: float = 0.1, *,
                 profile_undecided: bool = False) -> None:
        self._devices = devices
        self._interval_s = interval_s
        self._profile_undecided = profile_undecided
        self._sampler: CuptiPmSampler | None = None

    def sample_profiling(self) -> list[ProfilingSample]:
        """Every GPU NVML reports (the caller filters): for tools that want them all."""
        return self._built().sample_profiling()

    def sample_profiling_for(self, scope_of: ScopeOf) -> list[ProfilingSample]:
        """The GPUs of ``scope_of``'s answer only (:meth:`CuptiPmSampler.sample_profiling_for`)."""
        return self._built().sample_profiling_for(scope_of)

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()

    def _built(self) -> CuptiPmSampler:
        if self._sampler is None:
            from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler

            # Physical GPUs only: CUPTI refuses MIG devices (docs/gpu-readings.md). CUDA's
            # numbering is found by UUID when a GPU is started, so no environment is set here.
            gpus = [s.gpu for s in self._devices.sample_devices() if not s.gpu.is_mig]
            self._sampler = CuptiPmSampler(gpus, interval_s=self._interval_s,
                                           profile_undecided=self._profile_undecided)
        return self._sampler
