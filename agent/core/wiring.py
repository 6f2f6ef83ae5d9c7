"""Wiring: turns an :class:`AgentConfig` into GPU sources, collectors, a runner and the HTTP
exposition. Registration is explicit (a dict of name -> factory) and nothing happens at import.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client.registry import CollectorRegistry

from agent.core.catalog import CATALOG
from agent.core.collectors.base import Collector
from agent.core.collectors.derived import DerivedCollector
from agent.core.collectors.gpu import GpmCollector, GpuCollector, ProfilingCollector
from agent.core.collectors.process import ProcessCollector
from agent.core.config import AgentConfig
from agent.core.runner import Runner
from agent.core.targets import TargetResolver
from exporters.exposition.http import ExpositionServer
from exporters.exposition.snapshot import SnapshotCollector

log = logging.getLogger(__name__)


@dataclass
class Sources:
    """The GPU sources the collectors read; ``None`` where the backend is 'none'."""

    device: Any = None
    gpm: Any = None
    profiling: Any = None
    backend: Any = None  # the object to close()

    def close(self) -> None:
        """Close the backend and, when it is a separate object, the profiling source."""
        for part in {id(p): p for p in (self.backend, self.profiling) if p is not None}.values():
            if hasattr(part, "close"):
                part.close()


class LazyProfiling:
    """A ProfilingSource over CUPTI PM sampling, built on first use: it needs NVML's GPU list,
    and opens the GPU's performance monitors only when the profiling collector runs. A failed
    build is retried on the next call (the GPU may appear later)."""

    def __init__(self, nvml: Any, interval_s: float = 0.1) -> None:
        self._nvml = nvml
        self._interval_s = interval_s
        self._sampler: Any = None

    def sample_profiling(self) -> Any:
        if self._sampler is None:
            # CUPTI takes CUDA device indices; PCI order makes them agree with NVML's.
            os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
            from agent.core.hw.cupti_pm import CuptiPmSampler

            self._sampler = CuptiPmSampler([s.gpu for s in self._nvml.sample_devices()],
                                           interval_s=self._interval_s)
        return self._sampler.sample_profiling()

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()


def make_sources(cfg: AgentConfig, nvml_lib: Any | None = None) -> Sources:
    """Build the GPU sources for ``--gpu-backend``. A replay trace is parsed here, so a
    malformed one stops the agent before it starts (ReplayFormatError)."""
    replay = cfg.replay_path
    if replay is not None:
        from agent.core.hw.replay import ReplayBackend

        backend = ReplayBackend(replay)
        return Sources(backend, backend, backend, backend)
    if cfg.gpu_backend == "none":
        return Sources()
    from agent.core.hw.nvml import NvmlBackend

    nvml = NvmlBackend(lib=nvml_lib)
    return Sources(nvml, nvml, LazyProfiling(nvml), nvml)


COLLECTOR_FACTORIES: dict[str, Callable[[AgentConfig, Sources], Collector]] = {
    "process": lambda cfg, src: ProcessCollector(),
    "gpu": lambda cfg, src: GpuCollector(src.device),
    "gpm": lambda cfg, src: GpmCollector(src.gpm),
    "profiling": lambda cfg, src: ProfilingCollector(src.profiling),
    "derived": lambda cfg, src: DerivedCollector(cfg.thresholds),
}


def build_runner(cfg: AgentConfig, sources: Sources) -> Runner:
    collectors = [COLLECTOR_FACTORIES[name](cfg, sources) for name in cfg.enabled]
    targets = TargetResolver(cfg.pids, cfg.pidfile, cfg.process_name)
    return Runner(collectors, targets, cfg.interval)


def build_registry(runner: Runner) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SnapshotCollector(CATALOG, runner.latest))
    return registry


def build_server(cfg: AgentConfig, runner: Runner) -> ExpositionServer:
    host, port = cfg.host_port
    return ExpositionServer(build_registry(runner), host, port, runner.version,
                            runner.ready.is_set)
