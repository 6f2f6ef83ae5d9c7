"""``mrc-agent selfcheck --gpu``: the agent's GPU readings against references measured in the
same run, one PASS/FAIL/SKIP per metric; ``--dry`` runs the same code on a simulated GPU.

One run, in order (each window ``Plan.window_s`` long, 6 s on a GPU):

1. a priming poll of the agent's readers (``NvmlBackend``, ``CuptiPmSampler``): it starts
   PCIe and CUPTI sampling, primes GPM and drains NVML's utilisation buffer;
2. idle; pinned host->device copies; device->host copies; device-to-device copies; bf16
   GEMMs; N then 2N GEMMs; GEMM stretches around idle gaps of 50, 100 and 200 ms (the
   hardware activity timeline's idle windows); a peer copy when a second GPU shares NVLink
   with the first;
   each window polled (:mod:`.phases`) and compared (:mod:`.compare`);
   then host->device copies with PCIe read at the agent's cadences and over one long gap,
   and the throughput call on its own (:mod:`.pcie`);
3. the readers closed, a trace recorded with ``mrc-agent record``'s recorder from the sources
   ``make_sources`` builds, while a mixed workload runs;
4. the table printed and written, with a JSON result and the trace, to ``--out``.

The workload (:mod:`.workload`) is torch on a GPU, :class:`~.dry.DryWorkload` in
a dry run; the readers are the agent's own in both, fed by NVML and CUPTI or by the dry run's
stand-ins of those libraries. On a GPU the CUPTI sampler runs in a process of its own that does no
CUDA work (:mod:`.sampler`), as in the sidecar. On Hopper or newer a metric the agent
reports nothing for is a FAIL, not a SKIP (``compare.require``). Exit status: 0 when
nothing failed, 1 when a check failed; cli.py turns
:class:`~mrc_agent.agent.core.config.ConfigError` (bad flags, no GPU) into 2.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mrc_agent.agent.core.hw.base import SourceUnavailable
from mrc_agent.agent.core.hw.sources import Sources
from mrc_agent.agent.tools.selfcheck import compare as cmp
from mrc_agent.agent.tools.selfcheck import phases as ph
from mrc_agent.agent.tools.selfcheck.compare import TruthCheck
from mrc_agent.agent.tools.selfcheck.dry import DryModel, DryWorkload
from mrc_agent.agent.tools.selfcheck.dry_device import DryCupti
from mrc_agent.agent.tools.selfcheck.pcie import pcie_cadence_checks
from mrc_agent.agent.tools.selfcheck.sampler import LocalSampler, SamplerProcess, SamplerServer
from mrc_agent.agent.tools.selfcheck.workload import (
    GAP_PATTERN_S,
    CudaUnavailable,
    Workload,
    gap_sequence,
    run_mixed,
)

log = logging.getLogger(__name__)

TRACE_INTERVAL_S = 0.1
#: CUPTI PM sampling interval: the agent's default (``wiring``), the hardware activity
#: timeline's resolution.
PROFILING_INTERVAL_S = 0.02
DEFAULT_TRACE_S = 20.0
DEFAULT_DRY_TRACE_S = 2.0
#: --duration's range: the GPU run must stay inside a 5-minute budget.
MIN_DURATION_S, MAX_DURATION_S = 1.0, 120.0
TABLE_FILE, RESULT_FILE = "gpu_truth.txt", "gpu_truth.json"


@dataclass(frozen=True)
class Plan:
    """How long things run. GPU windows are 6 s: GPM values are only trusted from two GPM
    windows (~2.3 s) into a window, which leaves three or four of them."""

    window_s: float
    trace_s: float
    gpm_interval: float
    poll_s: float
    settle_s: float
    #: How far into a window PCIe rates / NVML utilisation rates are the window's own.
    pcie_settle_s: float = ph.PCIE_RATE_SETTLE_S
    util_settle_s: float = ph.GPU_UTIL_SETTLE_S
    #: The longest gap between two PCIe reads checked: 5 s of copies wrap a 32-bit byte
    #: counter ~60 times; a dry run keeps to its window (it wraps ~20 times in 1.5 s).
    pcie_gap_s: float = 5.0
    #: The activity-timeline phase: GEMMs this long between idle gaps, and how many rounds of
    #: ``workload.GAP_PATTERN_S`` (50, 100, 200 ms) gaps; five rounds make a 50 ms miss 20 %.
    gap_busy_s: float = 0.3
    gap_rounds: int = 5

    @classmethod
    def for_mode(cls, dry: bool, duration: float | None = None) -> Plan:
        trace = duration if duration is not None else (DEFAULT_DRY_TRACE_S if dry
                                                       else DEFAULT_TRACE_S)
        if dry:
            # GPM's shortest window (0.2 s). GPM values count from about 0.6 s into a window
            # (AgentReaders.gpm_settle), so 1.5 s leaves room for three or four GPM readings
            # even when a busy machine delays the polls. The simulated PCIe thread and
            # utilisation need no more than 0.3 s to settle.
            window = min(6.0, max(1.5, 0.3 * trace))
            # Two rounds of gaps between 0.1 s stretches: ~1.4 s of a run on the real clock.
            return cls(window, trace, 0.2, 0.05, 0.3, 0.3, 0.3, window, gap_busy_s=0.1,
                       gap_rounds=2)
        return cls(min(6.0, max(4.0, 0.3 * trace)), trace, 1.0, 0.1, 0.5)


@dataclass
class Rig:
    """Everything one run touches: the workload, the agent's readers under test, the sources
    the trace is recorded from (built after the readers are closed: CUPTI PM sampling takes
    one collector per device) and what to close."""

    mode: str
    work: Workload
    readers: ph.AgentReaders
    trace_sources: Callable[[], Sources]
    info: dict[str, Any]
    closers: list[Callable[[], None]] = field(default_factory=list)
    #: A fresh NVML library object for a second reader (a dry device's stand-in is one per
    #: reader; the real pynvml is shared, NVML counts its inits).
    nvml_lib: Callable[[], Any] | None = None
    #: The CUPTI sampler under test, in its own process on a GPU (its report goes in the JSON).
    sampler: Any = None

    def close_readers(self) -> None:
        for close in self.closers:
            close()
        self.closers.clear()


def nvml_backend(lib: Any | None, gpm_interval: float) -> Any:
    """The agent's NVML backend with the check's GPM window."""
    from mrc_agent.agent.core.hw.nvml import NvmlBackend

    return NvmlBackend(lib=lib, gpm_interval=gpm_interval)


def _sources(nvml_lib: Any | None, cupti_lib: Any | None) -> Sources:
    """``make_sources`` for ``--gpu-backend nvml``, as ``mrc-agent record`` builds them; a
    CUPTI stand-in replaces the lazily imported library in a dry run."""
    from mrc_agent.agent.core.config import AgentConfig
    from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler
    from mrc_agent.agent.core.wiring import make_sources

    cfg = AgentConfig(gpu_backend="nvml")
    if cupti_lib is None:
        return make_sources(cfg, profiling=True, profiling_interval_s=PROFILING_INTERVAL_S)
    base = make_sources(cfg, nvml_lib=nvml_lib, profiling=False)
    assert base.device is not None
    # The GPU under test only: with several, CuptiPmSampler warns about CUDA_DEVICE_ORDER,
    # which only the real LazyProfiling sets.
    prof = CuptiPmSampler([base.device.sample_devices()[0].gpu], lib=cupti_lib,
                          interval_s=PROFILING_INTERVAL_S)
    return Sources(base.device, base.gpm, prof, (*base.owned, prof))


def _readers(plan: Plan, nvml_lib: Any | None, cupti_lib: Any | None, work: Workload,
             log_dir: Path | None = None) -> tuple[ph.AgentReaders, list[Callable[[], None]],
                                                   dict[str, Any], Any]:
    from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler

    backend = nvml_backend(nvml_lib, plan.gpm_interval)
    try:
        devices = backend.sample_devices()
    except SourceUnavailable as exc:
        backend.close()
        raise CudaUnavailable(f"NVML unavailable ({exc})") from exc
    uuids = work.uuids()
    under_test = [s.gpu for s in devices if uuids and s.gpu.uuid == uuids[0]] or [devices[0].gpu]
    # Only the GPU under test: PM sampling on every GPU of a node costs them all.
    sampler: LocalSampler | SamplerProcess
    if cupti_lib is None:
        # The sidecar's situation: a process with no CUDA work of its own.
        sampler = SamplerProcess(under_test[0], PROFILING_INTERVAL_S,
                                 log_path=log_dir / "sampler.log" if log_dir else None)
    else:
        inner = CuptiPmSampler(under_test, lib=cupti_lib, interval_s=PROFILING_INTERVAL_S)
        sampler = LocalSampler(SamplerServer(inner, under_test[0], lib=cupti_lib))
    readers = ph.AgentReaders(backend, backend, sampler, plan.gpm_interval, plan.poll_s,
                              pcie_settle=plan.pcie_settle_s, util_settle=plan.util_settle_s)
    return readers, [sampler.close, backend.close], backend.info(), sampler


#: NVML_DEVICE_ARCH_* names (nvml.h), looked up by name: a stand-in module forwards them.
_ARCHITECTURES = ("KEPLER", "MAXWELL", "PASCAL", "VOLTA", "TURING", "AMPERE", "ADA", "HOPPER",
                  "BLACKWELL", "RUBIN", "DLA", "DLA2", "NPU3")


def part_of(lib: Any, uuid: str, capability: tuple[int, int] | None) -> dict[str, Any]:
    """The GPU's generation: CUDA's compute capability and NVML's architecture name."""
    arch: str | None = None
    try:
        lib.nvmlInit()
        try:
            code = lib.nvmlDeviceGetArchitecture(lib.nvmlDeviceGetHandleByUUID(uuid))
            names = [n for n in _ARCHITECTURES
                     if getattr(lib, f"NVML_DEVICE_ARCH_{n}", None) == code]
            arch = names[0] if names else str(code)
            if capability is None:
                capability = tuple(lib.nvmlDeviceGetCudaComputeCapability(
                    lib.nvmlDeviceGetHandleByUUID(uuid)))  # type: ignore[assignment]
        finally:
            lib.nvmlShutdown()
    except (lib.NVMLError, AttributeError) as exc:
        log.info("NVML architecture of %s unknown: %s", uuid, exc)
    return {"compute_capability": list(capability) if capability else None,
            "architecture": arch, "hopper_or_newer": cmp.hopper_or_newer(capability, arch)}


def gpu_rig(plan: Plan, out_dir: Path | None = None) -> Rig:
    """The real thing: torch on CUDA device 0, NVML and CUPTI. Raises CudaUnavailable."""
    # CUPTI and torch number devices as CUDA does; PCI order makes that NVML's order.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    import pynvml

    from mrc_agent.agent.tools.selfcheck.workload import TorchWorkload

    work = TorchWorkload()
    try:
        readers, closers, info, sampler = _readers(plan, None, None, work, out_dir)
    except BaseException:
        work.close()
        raise
    torch = work.torch
    info["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                     "device": torch.cuda.get_device_name(0)}
    uuids = work.uuids()
    info["part"] = part_of(pynvml, uuids[0] if uuids else "",
                           tuple(torch.cuda.get_device_capability(0)))
    return Rig("gpu", work, readers, lambda: _sources(None, None), info, closers,
               nvml_lib=lambda: pynvml, sampler=sampler)


def dry_rig(plan: Plan, model: DryModel | None = None) -> Rig:
    """The simulated GPU of :mod:`.dry` behind the agent's real readers."""
    from mrc_agent.agent.tools.selfcheck.dry_device import DryNvml

    model = model or DryModel()
    work = DryWorkload(model)
    readers, closers, info, sampler = _readers(plan, DryNvml(model), DryCupti(model), work)
    info["faults"] = asdict(model.faults)
    info["part"] = part_of(DryNvml(model), model.uuid(0), None)
    return Rig("dry", work, readers, lambda: _sources(DryNvml(model), DryCupti(model)), info,
               closers, nvml_lib=lambda: DryNvml(model), sampler=sampler)


# --- the run -------------------------------------------------------------------------------------

def measure(rig: Rig, plan: Plan, say: Callable[[str], None]) -> tuple[list[TruthCheck],
                                                                        list[ph.Phase]]:
    """Every window of the run and the checks they give (the trace aside)."""
    r, work = rig.readers, rig.work
    primed = r.poll()
    uuids = work.uuids()

    def nvml_uuid(cuda: int) -> str | None:
        """The NVML row of a CUDA device, matched by UUID (never by index)."""
        if cuda >= len(uuids):
            return None
        return uuids[cuda] if uuids[cuda] in primed.devices else None

    gpu = nvml_uuid(0)
    if gpu is None:
        gpu = next(iter(primed.devices), "")
        say(f"CUDA device 0's UUID is not among NVML's GPUs; checking NVML GPU {gpu}")
    time.sleep(plan.settle_s)
    start, first = r.clock(), len(r.polls)
    w = plan.window_s

    def run(name: str, what: str, action: Callable[[], Any]) -> ph.Phase:
        say(f"{what} ({name})")
        return ph.observe(r, name, action, plan.settle_s)

    idle = run("idle", f"idle for {w:g} s", lambda: work.idle(w))
    h2d = run("h2d", f"pinned host->device copies for {w:g} s", lambda: work.copy("h2d", w))
    d2h = run("d2h", f"device->host copies for {w:g} s", lambda: work.copy("d2h", w))
    d2d = run("d2d", f"device-to-device copies for {w:g} s", lambda: work.copy("d2d", w))
    gemm = run("gemm", f"bf16 GEMMs for {w:g} s", lambda: work.gemm(seconds=w))
    assert gemm.work is not None
    per_gemm = gemm.work.gpu_s / max(gemm.work.count, 1)
    n = max(8, round(w / 3 / per_gemm)) if per_gemm > 0 else 8
    single = run("gemm_n", f"{n} GEMMs", lambda: work.gemm(count=n))
    double = run("gemm_2n", f"{2 * n} GEMMs", lambda: work.gemm(count=2 * n))
    gaps = gap_sequence(plan.gap_rounds)
    gapped = run("idle_gaps", f"GEMMs in {plan.gap_busy_s * 1e3:g} ms stretches around "
                 f"{len(gaps)} idle gaps of {'/'.join(f'{g * 1e3:g}' for g in GAP_PATTERN_S)} "
                 "ms", lambda: work.idle_gaps(plan.gap_busy_s, gaps))
    phases = [idle, h2d, d2h, d2d, gemm, single, double, gapped]

    checks = ph.pcie_checks(h2d, gpu, r) + ph.pcie_checks(d2h, gpu, r)
    checks += ph.dram_checks(d2d, idle, gpu, r)
    checks += ph.gemm_checks(gemm, idle, gpu, r)
    checks.append(ph.doubling_check(single, double, gpu, r))
    checks.append(ph.activity_gap_check(gapped, gpu, r, PROFILING_INTERVAL_S))
    peer = ph.nvlink_peer(primed, gpu, work, nvml_uuid)
    if peer is None:
        checks.append(cmp.skip("nvlink.peer", "unverifiable on one GPU: no second GPU with "
                               "NVLink peer access to the GPU under test", "B"))
    else:
        cuda_peer, nvml_peer = peer
        copy = run("peer", f"peer copies GPU {gpu} -> GPU {nvml_peer} for {w:g} s",
                   lambda: work.peer_copy(0, cuda_peer, w))
        phases.append(copy)
        checks += ph.nvlink_checks(copy, gpu, nvml_peer)
    checks.append(ph.timestamp_check(r, gpu, start, first))
    if rig.nvml_lib is not None:
        nvml_lib = rig.nvml_lib
        cadence, copy_work = pcie_cadence_checks(
            work, lambda: nvml_backend(nvml_lib(), plan.gpm_interval), nvml_lib, gpu, w,
            plan.pcie_gap_s, plan.settle_s, plan.pcie_settle_s, say)
        checks += cadence
        phases.append(ph.Phase("pcie_cadence", copy_work, primed, primed, [], copy_work.start,
                               copy_work.end))
    if rig.sampler is not None:
        rig.info["cupti_process"] = rig.sampler.report()
        checks.append(ph.sampler_check(rig.info["cupti_process"], r))
    rig.info["gpu_under_test"] = gpu
    part = rig.info.get("part") or {}
    if part.get("hopper_or_newer"):
        cc = part.get("compute_capability")
        what = f"compute capability {cc[0]}.{cc[1]}" if cc else part.get("architecture")
        checks = cmp.require(checks, f"this Hopper+ GPU ({what})")
    return checks, phases


def record_trace(rig: Rig, plan: Plan, path: Path) -> TruthCheck:
    """``mrc-agent record``'s recorder over ``make_sources``' sources for ``plan.trace_s``
    while the mixed workload runs; the trace must replay."""
    from mrc_agent.agent.core.hw.replay import ReplayBackend, ReplayFormatError, load_trace
    from mrc_agent.agent.tools.record import record

    stop = threading.Event()
    failed: list[BaseException] = []

    def mixed() -> None:
        try:
            run_mixed(rig.work, stop, max(0.2, plan.trace_s / 10))
        except BaseException as exc:  # reported in the trace's row
            failed.append(exc)

    thread = threading.Thread(target=mixed, name="selfcheck-mixed", daemon=True)
    err = io.StringIO()
    sources = rig.trace_sources()
    thread.start()
    try:
        with open(path, "w", encoding="utf-8") as out:
            lines = record(sources, out, plan.trace_s, TRACE_INTERVAL_S, err=err)
    except SourceUnavailable as exc:
        return cmp.TruthCheck("trace.record", cmp.FAIL, note=f"no GPU to record from: {exc}")
    finally:
        stop.set()
        thread.join()
        sources.close()
    expected = plan.trace_s / TRACE_INTERVAL_S
    notes = [f"{path.name}: {lines} samples"] + err.getvalue().strip().splitlines()
    verdict = cmp.PASS if lines >= 0.5 * expected else cmp.FAIL
    if failed:
        verdict = cmp.FAIL
        notes.append(f"mixed workload failed: {failed[0]!r}")
    try:
        replay = ReplayBackend(str(path))
        notes.append(f"replays: {len(replay.identities)} GPU(s), {replay.period:.1f} s")
        timed = [tr for tr in load_trace(str(path)).values() if tr.activity_times]
        notes.append(f"activity timeline: {sum(len(tr.activity_times) for tr in timed)} "
                     f"points on {len(timed)} GPU(s)")
    except ReplayFormatError as exc:
        verdict = cmp.FAIL
        notes.append(f"does not replay: {exc}")
    return cmp.TruthCheck("trace.record", verdict, float(lines), expected, lines / expected,
                          (0.5, float("inf")), "lines", "; ".join(notes),
                          band_text=">=0.5")


def trace_name(mode: str, gpu_name: str) -> str:
    """``h200_trace.jsonl`` for an "NVIDIA H200"; ``dry_...`` in a dry run."""
    words = [w for w in re.findall(r"[a-z0-9]+", gpu_name.lower()) if w != "nvidia"]
    slug = words[0] if words else "gpu"
    return f"{'dry_' if mode == 'dry' else ''}{slug}_trace.jsonl"


def run_rig(rig: Rig, plan: Plan, out_dir: Path, stdout: TextIO | None = None,
            stderr: TextIO | None = None) -> int:
    """One whole run on ``rig``; writes the table, the JSON and the trace to ``out_dir``.
    Returns 0 when no check failed, 1 otherwise."""
    began, began_wall = time.monotonic(), time.time()
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr

    def say(msg: str) -> None:
        print(f"mrc-agent selfcheck: {msg}", file=stderr, flush=True)

    try:
        checks, phases = measure(rig, plan, say)
    finally:
        rig.close_readers()
    gpus = rig.info.get("gpus") or [{}]
    under = rig.info.get("gpu_under_test", "")
    described = next((g for g in gpus if g.get("uuid") == under), gpus[0])
    trace = out_dir / trace_name(rig.mode, str(described.get("name", "gpu")))
    say(f"recording a {plan.trace_s:g} s trace under a mixed workload to {trace}")
    try:
        checks.append(record_trace(rig, plan, trace))
    finally:
        rig.work.close()
    header = (f"mrc-agent selfcheck ({rig.mode}): GPU {described.get('index', '?')} "
              f"{described.get('name', '?')} {described.get('uuid', '')}, "
              f"driver {rig.info.get('driver_version')}; "
              f"windows {plan.window_s:g} s, trace {plan.trace_s:g} s\n")
    table = header + cmp.format_table(checks)
    code = cmp.exit_code(checks)
    result = {
        "tool": "mrc-agent selfcheck", "mode": rig.mode, "exit_code": code,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(began_wall)),
        "elapsed_s": round(time.monotonic() - began, 3), "plan": asdict(plan),
        "device": rig.info, "counts": cmp.counts(checks),
        "checks": [c.as_json() for c in checks], "trace": str(trace),
        "reader_errors": rig.readers.errors,
        "workload": [asdict(p.work) | {"phase": p.name} for p in phases if p.work is not None],
    }
    (out_dir / TABLE_FILE).write_text(table, encoding="utf-8")
    (out_dir / RESULT_FILE).write_text(json.dumps(result, indent=2, default=str) + "\n",
                                       encoding="utf-8")
    stdout.write(table)
    stdout.write(f"wrote {out_dir / TABLE_FILE}, {out_dir / RESULT_FILE}, {trace}\n")
    stdout.flush()
    return code


def run_selfcheck_command(args: Any) -> int:
    """``mrc-agent selfcheck``; bad input or no GPU raises ConfigError (exit 2 in cli.py)."""
    from mrc_agent.agent.core.config import ConfigError

    if args.duration is not None and not MIN_DURATION_S <= args.duration <= MAX_DURATION_S:
        raise ConfigError(f"--duration must be {MIN_DURATION_S:g}-{MAX_DURATION_S:g} seconds")
    out = Path(args.out or f"mrc-selfcheck-{time.strftime('%Y%m%dT%H%M%S')}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} exists and is not a directory")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {str(out)!r}: {exc.strerror or exc}") from exc
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    plan = Plan.for_mode(args.dry, args.duration)
    try:
        rig = dry_rig(plan) if args.dry else gpu_rig(plan, out)
    except CudaUnavailable as exc:
        if created:
            out.rmdir()  # made a moment ago, still empty: leave nothing behind
        raise ConfigError(f"no GPU to check: {exc} (--dry runs on a simulated GPU)") from exc
    return run_rig(rig, plan, out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mrc_agent.agent.tools.flags import SELFCHECK, SELFCHECK_FLAGS

    SELFCHECK_FLAGS.add_flags(parser, SELFCHECK)


run = run_selfcheck_command
