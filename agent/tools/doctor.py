"""``mrc-agent doctor``: a table of what this host can deliver, and a non-zero exit when a
collector that was asked for cannot run.

"Asked for" means named with ``--collector``, or a GPU collector under an explicit
``--gpu-backend nvml``/``replay:…``, or the process collector when targets are configured. The
defaults under ``--gpu-backend auto`` are best-effort and never fail the doctor.

For each target it also says which GPUs it is attributed and from which source, and which GPUs
the agent would report (agent.core.attribution, docs/attribution.md).

The profiling check tries CUPTI PM sampling on those GPUs only, as the agent's profiling does
(``profiling_scope``), and prints the CUPTI version. Where CUPTI answers busy while an
``mrc-agent run`` process runs beside doctor (same container, or a pod sharing its process
namespace), it says the profiler is held by this pod's agent, as information, not a failure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TextIO

from mrc_agent.agent.core.attribution import TargetView, decide, explain, read_view
from mrc_agent.agent.core.config import (
    DOCTOR,
    AgentConfig,
    ConfigError,
    add_flags,
    config_from_args,
)
from mrc_agent.agent.core.hw.base import DeviceSample, HardwareError, SourceUnavailable
from mrc_agent.agent.core.hw.procfs import ProcessGone, ProcFS
from mrc_agent.agent.core.targets import TargetResolver

CAP_SYS_PTRACE = 19
EXIT_MISSING = 1


@dataclass
class Check:
    what: str
    ok: bool | None  # None: informational
    detail: str
    collector: str = ""


def ptrace_ok(pid: int, procfs: ProcFS) -> tuple[bool, str]:
    """Whether py-spy could attach to ``pid`` from here (root/CAP_SYS_PTRACE or same UID
    under a permissive Yama scope)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip())
    except OSError:
        scope = 0
    cap = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                cap = int(line.split()[1], 16)
    if cap & (1 << CAP_SYS_PTRACE):
        return (scope < 3, f"CAP_SYS_PTRACE held, yama ptrace_scope={scope}")
    try:
        uid = os.stat(f"{procfs.root}/{pid}").st_uid
    except OSError as exc:
        return (False, str(exc))
    if uid != os.getuid():
        return (False, "different user and no CAP_SYS_PTRACE")
    if scope >= 1:
        return (False, f"yama ptrace_scope={scope} allows only descendants; add CAP_SYS_PTRACE")
    return (True, "same user, yama ptrace_scope=0")


def gather(cfg: AgentConfig, nvml_lib: Any | None = None, cupti_lib: Any | None = None,
           procfs: ProcFS | None = None) -> list[Check]:
    procfs = procfs or ProcFS()
    checks: list[Check] = []
    from mrc_agent.agent.core.hw.replay import ReplayBackend, ReplayFormatError
    from mrc_agent.agent.core.wiring import open_gpu_backend

    try:
        backend = open_gpu_backend(cfg.gpu_backend, nvml_lib)
    except ReplayFormatError as exc:
        raise ConfigError(str(exc)) from exc
    devices: list[DeviceSample] | None = None  # for the targets' GPU attribution
    if isinstance(backend, ReplayBackend):
        devices = _devices(backend)
        ids = backend.identities
        checks.append(Check("replay trace", True, f"{cfg.replay_path}: {len(ids)} GPU(s), "
                            f"period {backend.period:.1f} s", "gpu"))
        for kind, method in (("gpm", backend.sample_gpm), ("profiling", backend.sample_profiling)):
            try:
                method()
                checks.append(Check(f"{kind} fields", True, "present in the trace", kind))
            except SourceUnavailable as exc:
                checks.append(Check(f"{kind} fields", False, str(exc), kind))
    elif backend is None:
        checks.append(Check("GPU backend", None, "none: GPU collectors are off"))
    else:
        nvml = backend
        info = nvml.info()
        if not info["available"]:
            checks.append(Check("NVML", False, info["error"] or info["reason"] or "unavailable",
                                "gpu"))
            checks.append(Check("GPM", False, "needs NVML", "gpm"))
            checks.append(Check("profiling counters", False, "needs NVML", "profiling"))
        else:
            checks.append(Check("NVML", True, f"driver {info['driver_version']}, NVML "
                                f"{info['nvml_version']}, CUDA {info['cuda_driver_version']}",
                                "gpu"))
            gpus = info["gpus"]
            checks.append(Check("GPUs", bool(gpus), ", ".join(
                f"{g['index']}: {g['name']} {g['uuid']}" for g in gpus) or "none", "gpu"))
            gpm = [g["index"] for g in gpus if g.get("gpm_supported")]
            checks.append(Check("GPM", bool(gpm), f"supported on GPU(s) {gpm}" if gpm else
                                "not supported (Hopper or newer needed)", "gpm"))
            for g in gpus:
                if g.get("mig_devices"):
                    checks.append(Check(f"GPU {g['index']} MIG", None, _mig_detail(g)))
            links = {g["index"]: g.get("nvlink_active_links", 0) for g in gpus}
            checks.append(Check("NVLink", None, ", ".join(
                f"GPU {i}: {n} active link(s)" for i, n in links.items())))
            devices = _devices(nvml)
            checks.append(Check("CUPTI", None, cupti_version(cupti_lib)))
            checks.append(_profiling_check(nvml, cupti_lib, cfg, procfs, devices))
            checks.extend(_reading_checks(nvml, devices, cfg.gpm_interval))
        nvml.close()
    checks.extend(_target_checks(cfg, procfs, devices))
    for tool in ("py-spy", "pidstat"):
        path = shutil.which(tool)
        checks.append(Check(tool, None, path or "not installed"))
    return checks


def _mig_detail(g: dict[str, Any]) -> str:
    devices = g["mig_devices"]
    gpm = "GPM per GPU instance" if g.get("gpm_supported") else "no GPM"
    return (f"on, {len(devices)} MIG device(s) ({', '.join(devices)}): memory, processes and "
            f"{gpm} per MIG device (labelled by its MIG UUID); not available in MIG mode: GPU "
            "and memory utilisation, utilisation samples (so no idle windows or starvation), "
            "CUPTI profiling counters")


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f} MB/s"


def _reading_checks(nvml: Any, devices: list[DeviceSample] | None,
                    gpm_interval: float) -> list[Check]:
    """Which reading is live per GPU where NVML leaves a choice, with both PCIe readings
    side by side over one second so the throughput call's unit can be judged on the node."""
    out = [Check("GPM window", None, f"{gpm_interval:g} s (--gpm-interval); faster sampling "
                 "repeats the last window's values")]
    try:
        pcie = nvml.compare_pcie()
    except HardwareError as exc:
        pcie = {}
        out.append(Check("PCIe readings", None, f"not compared: {exc}"))
    for s in devices or []:
        src = s.sources
        row = pcie.get(s.gpu.uuid, {})
        out.append(Check(
            f"GPU {s.gpu.index} readings", None,
            f"PCIe from {src.get('pcie', '-')} (counters TX {_rate(row.get('counter_tx'))} "
            f"RX {_rate(row.get('counter_rx'))} | throughput call TX "
            f"{_rate(row.get('call_tx'))} RX {_rate(row.get('call_rx'))}); NVLink "
            f"{src.get('nvlink', 'none')}; utilisation-sample clock "
            f"{src.get('util_clock', 'no samples yet')}"))
    return out


def _profiling_check(nvml: Any, cupti_lib: Any | None, cfg: AgentConfig, procfs: ProcFS,
                     devices: list[DeviceSample] | None) -> Check:
    """Try CUPTI PM sampling on the GPUs the agent would profile: the pod's (the same
    attribution and scope as the profiling collector), never every GPU of the node, since
    sampling holds a GPU's performance monitors and would shut a neighbour's profiler out."""
    from mrc_agent.agent.core.collectors.profiling import profiling_scope
    from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler

    att = decide(cfg.gpus, _target_views(cfg, procfs), devices or [])
    try:
        gpus = [s.gpu for s in (devices or nvml.sample_devices()) if not s.gpu.is_mig]
        sampler = CuptiPmSampler(gpus, lib=cupti_lib, profile_undecided=cfg.profile_unattributed)
        try:
            sampler.sample_profiling_for(lambda given: profiling_scope(att, given))
            return Check("profiling counters", True, "CUPTI PM sampling works", "profiling")
        finally:
            sampler.close()
    except SourceUnavailable as exc:
        if exc.reason == "profiler_busy":
            agents = agent_pids(procfs)
            if agents:
                # Informational: the agent beside doctor holding the profiler is the working
                # case, not a fault; doctor cannot sample beside it (one profiler per GPU).
                return Check("profiling counters", None, (
                    f"held by this pod's agent (PID {', '.join(map(str, agents))} runs "
                    "`mrc-agent run`; CUPTI answered busy, so doctor cannot try it beside the "
                    "agent: see the agent's mrc_agent_compute_memory_source_info)"), "profiling")
        return Check("profiling counters", False, f"{exc.reason}: {exc.detail}", "profiling")
    except HardwareError as exc:
        return Check("profiling counters", False, str(exc), "profiling")


def agent_pids(procfs: ProcFS) -> list[int]:
    """The other processes in this PID namespace that run ``mrc-agent run`` (or ``python -m
    mrc_agent.agent run``): the pod's agent when doctor is exec'd into its container or the pod
    shares its process namespace. Doctor cannot ask CUPTI who holds the performance monitors;
    this is how it tells "the agent beside it" from another profiler."""
    found = []
    for pid in sorted(procfs.pids()):
        if pid == os.getpid():
            continue
        try:
            words = procfs.cmdline(pid).split()
        except ProcessGone:
            continue
        programs = [w for w in words if os.path.basename(w) == "mrc-agent" or w.startswith(
            "mrc_agent.agent")]
        if programs and "run" in words[words.index(programs[0]) + 1:]:
            found.append(pid)
    return found


def cupti_version(lib: Any | None) -> str:
    """The CUPTI binding and library versions doctor would profile with. cupti-python (13.4)
    has no call for ``cuptiGetVersion``, so these are the installed packages' versions; a
    stand-in library says its own (``version``)."""
    if lib is not None:
        return str(getattr(lib, "version", "a stand-in library of unknown version"))
    parts = []
    for dist, what in (("cupti-python", "binding"), ("nvidia-cuda-cupti", "libcupti wheel")):
        try:
            parts.append(f"{dist} {metadata.version(dist)} ({what})")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return ", ".join(parts)


def _devices(backend: Any) -> list[DeviceSample] | None:
    try:
        samples: list[DeviceSample] = backend.sample_devices()
        return samples
    except HardwareError:  # SourceUnavailable too: the GPU checks above say why
        return None


def _target_views(cfg: AgentConfig, procfs: ProcFS) -> list[TargetView]:
    """What /proc says about each configured target, for the GPU attribution ([] without)."""
    resolver = TargetResolver(cfg.pids, cfg.pidfile, cfg.process_name, procfs=procfs)
    if not resolver.configured:
        return []
    return [read_view(procfs, t.pid) for t in resolver.resolve()]


def _target_checks(cfg: AgentConfig, procfs: ProcFS,
                   devices: list[DeviceSample] | None = None) -> list[Check]:
    resolver = TargetResolver(cfg.pids, cfg.pidfile, cfg.process_name, procfs=procfs)
    if not resolver.configured:
        return [Check("targets", None, "none configured (--pid, --pidfile, --process-name)")]
    targets = resolver.resolve()
    if not targets:
        return [Check("targets", False, "no process matches", "process")]
    out = []
    views = []
    for t in targets:
        try:
            st = procfs.stat(t.pid)
            procfs.thread_user_ticks(t.pid)
            out.append(Check(f"target {t.pid}", True, f"{st.comm}: /proc readable", "process"))
        except ProcessGone as exc:
            out.append(Check(f"target {t.pid}", False, str(exc), "process"))
            continue
        ok, why = ptrace_ok(t.pid, procfs)
        out.append(Check(f"ptrace {t.pid} (py-spy)", ok, why))
        views.append(read_view(procfs, t.pid))
    if devices is not None:  # which GPUs each target is attributed, and from which source
        att = decide(cfg.gpus, views, devices)
        out.extend(Check(what, None, detail) for what, detail in explain(att))
    return out


def render(checks: list[Check], out: TextIO) -> None:
    width = max(len(c.what) for c in checks)
    for c in checks:
        mark = {True: "ok  ", False: "FAIL", None: "info"}[c.ok]
        out.write(f"{mark}  {c.what.ljust(width)}  {c.detail}\n")


def run_doctor(cfg: AgentConfig, explicit_collectors: set[str], explicit_backend: bool,
               out: TextIO = sys.stdout, **libs: Any) -> int:
    checks = gather(cfg, **libs)
    render(checks, out)
    requested = set(explicit_collectors)
    if explicit_backend and cfg.gpu_backend != "none":
        requested |= {"gpu"} | ({"gpm"} if cfg.collectors.get("gpm") else set())
    if cfg.pids or cfg.pidfile or cfg.process_name:
        requested.add("process")
    failed = sorted({c.collector for c in checks if c.ok is False and c.collector in requested})
    if failed:
        out.write(f"\nrequested collector(s) cannot run: {', '.join(failed)}\n")
        return EXIT_MISSING
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, DOCTOR)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    return run_doctor(cfg, explicit_collectors=set(args.enable),
                      explicit_backend=args.gpu_backend is not None)
