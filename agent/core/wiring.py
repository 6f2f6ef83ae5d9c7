"""Wiring, in one place: turns an :class:`AgentConfig` into GPU sources, collectors, a runner
and the HTTP exposition. ``run``, ``record``, ``doctor``, ``demo`` and ``diagnose`` all build
their GPU backend and collectors here. Nothing happens at import.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.registry import CollectorRegistry

from mrc_agent.agent.core.catalog import CATALOG
from mrc_agent.agent.core.collectors import BY_NAME, PASS_FINISHERS
from mrc_agent.agent.core.collectors.base import BuildContext, Collector, StackSettings
from mrc_agent.agent.core.config import AgentConfig
from mrc_agent.agent.core.hw.profiling import LazyProfiling
from mrc_agent.agent.core.hw.sources import Closable, Sources
from mrc_agent.agent.core.runner import Runner
from mrc_agent.agent.core.targets import TargetResolver
from mrc_agent.exporters.exposition.http import ExpositionServer, Routes
from mrc_agent.exporters.exposition.http.webconfig import WebConfig
from mrc_agent.exporters.exposition.snapshot import SnapshotCollector

if TYPE_CHECKING:
    from mrc_agent.agent.core.hw.nvml import NvmlBackend
    from mrc_agent.agent.core.hw.replay import ReplayBackend

#: How often the lazily built CUPTI sampler reads the performance monitors by default: 20 ms,
#: so the hardware activity timeline (``cupti_timeline``) sees idle windows of 50 ms.
PROFILING_INTERVAL_S = 0.02


def open_gpu_backend(backend: str, nvml_lib: Any | None = None, *,
                     pcie_thread: bool = True,
                     gpm_interval: float = 1.0) -> ReplayBackend | NvmlBackend | None:
    """The GPU backend ``--gpu-backend`` names: ``replay:PATH`` (the trace is parsed here, so
    a malformed one stops the caller before it starts: ReplayFormatError), ``none`` (None), or
    NVML for ``auto`` and ``nvml`` (which reports "unavailable" per call when there is no
    GPU). ``gpm_interval`` is NVML GPM's window in seconds."""
    if backend.startswith("replay:"):
        from mrc_agent.agent.core.hw.replay import ReplayBackend

        return ReplayBackend(backend[len("replay:"):])
    if backend == "none":
        return None
    from mrc_agent.agent.core.hw.nvml import NvmlBackend

    return NvmlBackend(lib=nvml_lib, pcie_thread=pcie_thread, gpm_interval=gpm_interval)


def make_sources(cfg: AgentConfig, nvml_lib: Any | None = None, *, profiling: bool = True,
                 profiling_interval_s: float = PROFILING_INTERVAL_S) -> Sources:
    """The GPU sources for ``cfg.gpu_backend``. Under NVML the profiling source is CUPTI PM
    sampling built on first use, profiling only the pod's GPUs (``cfg.profile_unattributed``
    says whether every GPU while that is undecided); ``profiling=False`` leaves it out."""
    from mrc_agent.agent.core.hw.replay import ReplayBackend

    backend = open_gpu_backend(cfg.gpu_backend, nvml_lib, gpm_interval=cfg.gpm_interval)
    if backend is None:
        return Sources()
    if isinstance(backend, ReplayBackend):
        return Sources(backend, backend, backend, (backend,))
    lazy = (LazyProfiling(backend, profiling_interval_s,
                          profile_undecided=cfg.profile_unattributed) if profiling else None)
    owned: tuple[Closable, ...] = (backend,) if lazy is None else (backend, lazy)
    return Sources(backend, backend, lazy, owned)


def build_collectors(cfg: AgentConfig, sources: Sources,
                     names: Iterable[str] | None = None) -> list[Collector]:
    """The collectors ``names`` (default: the enabled ones), in sampling order."""
    wanted = set(cfg.enabled if names is None else names)
    ctx = BuildContext(sources, cfg.thresholds, gpus=cfg.gpus,
                       stacks=StackSettings(interval=cfg.stacks_interval, top_k=cfg.stacks_top_k))
    return [d.factory(ctx) for name, d in BY_NAME.items() if name in wanted]


def build_runner(cfg: AgentConfig, sources: Sources) -> Runner:
    targets = TargetResolver(cfg.pids, cfg.pidfile, cfg.process_name)
    return Runner(build_collectors(cfg, sources), targets, cfg.interval,
                  finishers=PASS_FINISHERS)


def build_registry(runner: Runner) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SnapshotCollector(CATALOG, runner.latest))
    return registry


def build_server(cfg: AgentConfig, runner: Runner, routes: Routes | None = None,
                 web: WebConfig | None = None) -> ExpositionServer:
    """The agent's exposition server for ``runner``'s snapshots, with optional extra routes
    (the on-alert capture endpoints) and the TLS, basic auth and headers of the web
    configuration file (:func:`mrc_agent.exporters.exposition.http.webconfig.load_web_config`).
    Binds now: "address in use" raises OSError here."""
    host, port = cfg.host_port
    web = web or WebConfig()
    return ExpositionServer(build_registry(runner), host, port, runner.version,
                            runner.not_ready_reason, routes=routes, tls=web.tls, auth=web.auth,
                            headers=web.headers)
