"""``mrc-agent selfcheck``'s CUPTI rows as the sidecar runs them: the agent's own
:class:`~mrc_agent.agent.core.hw.cupti_pm.CuptiPmSampler` in a process that does no CUDA work of its
own, while the workload runs in another one.

The sidecar never imports torch and never creates a CUDA context beyond what the sampler
itself takes (``cuInit``, and a primary context only where ``enable()`` still refuses), so
the check must not either: a sampler beside torch in one process cannot show whether PM
sampling enables without a context, what a retained context costs, or whether the counters
are device-wide. :class:`SamplerProcess` starts ``python -m
mrc_agent.agent.tools.selfcheck.sampler`` and speaks JSON lines with it; it is a
``ProfilingSource``, so the self-check polls it like any reader. The child's
:class:`SamplerServer` answers ``sample`` (the sampler's samples or its error) and ``report``:

- the NVML process memory of the sampler's process before its first sample and after PM
  sampling started (the retained context's cost), with the contexts the sampler holds;
- which ``libcupti.so`` the process mapped (``/proc/self/maps``) and the versions of the
  ``nvidia-cuda-cupti`` / ``cupti-python`` distributions, and whether the library lies inside
  the wheel's files;
- cupti-python's own answers: ``profiler_host.get_supported_chips()``,
  ``get_single_pass_sets(chip)``, ``get_metrics_in_single_pass_set(chip, set)`` and the
  ``get_metric_properties`` of the configured metrics, to hold against
  ``tests/data/cupti_sets``;
- whether torch was imported in the process (it must not have been).

A dry run has no second process to put a simulated GPU in (the model lives in the parent),
so :class:`LocalSampler` runs the same server in-process through the same JSON encoding.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import select
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from mrc_agent.agent.core.hw.base import (
    GPUIdentity,
    HardwareError,
    ProfilingSample,
    SourceUnavailable,
)

log = logging.getLogger(__name__)

MODULE = "mrc_agent.agent.tools.selfcheck.sampler"
#: Longest a request may take: the first sample enables, queries sets and configures.
REPLY_TIMEOUT_S = 120.0
_SAMPLE_FIELDS = [f.name for f in dataclasses.fields(ProfilingSample) if f.name != "gpu"]


# --- the encoding ------------------------------------------------------------------------------

def sample_to_json(sample: ProfilingSample) -> dict[str, Any]:
    return {name: getattr(sample, name) for name in _SAMPLE_FIELDS}


def sample_from_json(gpu: GPUIdentity, data: dict[str, Any]) -> ProfilingSample:
    return ProfilingSample(gpu=gpu, **{k: v for k, v in data.items() if k in _SAMPLE_FIELDS})


def error_from_json(data: dict[str, Any]) -> HardwareError:
    if data.get("kind") == "unavailable":
        return SourceUnavailable(str(data.get("reason")), str(data.get("detail", "")))
    return HardwareError(str(data.get("detail", "")))


# --- the child's side ----------------------------------------------------------------------------

def mapped_libraries(needle: str = "libcupti.so", maps: Path = Path("/proc/self/maps")
                     ) -> list[str]:
    """The paths of the mapped files whose name contains ``needle``, in mapping order."""
    try:
        text = maps.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    out: list[str] = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and needle in Path(parts[5]).name and parts[5] not in out:
            out.append(parts[5])
    return out


def distribution(name: str, paths: list[str]) -> dict[str, Any]:
    """A distribution's version and whether one of ``paths`` is among its files."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return {"name": name, "version": None}
    files = {str(Path(str(dist.locate_file(f))).resolve()) for f in dist.files or ()}
    owned = [p for p in paths if str(Path(p).resolve()) in files]
    return {"name": name, "version": dist.version, "owns": owned}


def cupti_answers(lib: Any, chip: str | None, metrics: list[str]) -> dict[str, Any]:
    """cupti-python's answers for the chip: supported chips, its single-pass sets and their
    metrics, and the properties of the configured ``metrics``. Errors are recorded, not
    raised: this is evidence, not a step the sampler needs."""
    host = getattr(lib, "profiler_host", None)
    out: dict[str, Any] = {"chip": chip}
    if host is None or chip is None:
        out["error"] = "no profiler_host module or no chip name"
        return out

    def ask(key: str, fn: Callable[[], Any]) -> Any:
        try:
            value = fn()
        except Exception as exc:  # recorded as evidence for the report
            out.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"
            return None
        out[key] = value
        return value

    ask("supported_chips", lambda: list(host.get_supported_chips()))
    sets = ask("single_pass_sets", lambda: list(host.get_single_pass_sets(chip))) or []
    out["metrics_in_set"] = {}
    for name in sets:
        try:
            out["metrics_in_set"][name] = list(host.get_metrics_in_single_pass_set(chip, name))
        except Exception as exc:  # recorded as evidence for the report
            out.setdefault("errors", {})[f"metrics_in_set:{name}"] = f"{type(exc).__name__}: {exc}"
    props: dict[str, Any] = {}
    try:
        ph = host.ProfilerHost(chip, host.ProfilerType.PM_SAMPLING)
        ph.initialize()
    except Exception as exc:  # recorded as evidence for the report
        out.setdefault("errors", {})["ProfilerHost"] = f"{type(exc).__name__}: {exc}"
        return out
    try:
        for metric in metrics:
            try:
                p = ph.get_metric_properties(metric)
                props[metric] = {"description": p.description, "hw_unit": p.hw_unit,
                                 "dim_unit": p.dim_unit, "metric_type": _name(p.metric_type),
                                 "scope": _name(p.metric_collection_scope)}
            except Exception as exc:  # recorded as evidence for the report
                props[metric] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        ph.deinitialize()
    out["metric_properties"] = props
    return out


def _name(value: Any) -> str:
    return str(getattr(value, "name", value))


class SamplerServer:
    """The sampler under test and the evidence about it, answering one request at a time.

    ``lib`` is the ``cupti`` package the sampler uses (``None``: the real one, imported once
    the sampler has loaded it); ``memory`` reads the NVML process memory of this process
    (``None`` where there is no NVML to ask, as in a dry run).
    """

    def __init__(self, sampler: Any, gpu: GPUIdentity, lib: Any | None = None,
                 memory: Callable[[], dict[str, Any]] | None = None,
                 own_process: bool = False) -> None:
        self.sampler, self.gpu, self._lib, self._memory = sampler, gpu, lib, memory
        #: Whether this process is the sampler's alone (the child), so torch in it is a fault.
        self.own_process = own_process
        self.memory_before = self._read_memory()
        self.memory_started: dict[str, Any] | None = None
        self.started: ProfilingSample | None = None
        self.statuses: list[tuple[str, str]] = []

    def _read_memory(self) -> dict[str, Any] | None:
        if self._memory is None:
            return None
        try:
            return self._memory()
        except Exception as exc:  # evidence only; the sampler's own rows say the rest
            return {"error": f"{type(exc).__name__}: {exc}"}

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        cmd = request.get("cmd")
        if cmd == "sample":
            return self._sample()
        if cmd == "report":
            return {"ok": self.report()}
        if cmd == "close":
            self.sampler.close()
            return {"ok": None}
        return {"error": {"kind": "hardware", "detail": f"unknown command {cmd!r}"}}

    def _sample(self) -> dict[str, Any]:
        try:
            samples = self.sampler.sample_profiling()
        except SourceUnavailable as exc:
            reply: dict[str, Any] = {"error": {"kind": "unavailable", "reason": exc.reason,
                                               "detail": exc.detail}}
        except HardwareError as exc:
            reply = {"error": {"kind": "hardware", "detail": str(exc)}}
        else:
            reply = {"ok": [sample_to_json(s) for s in samples]}
            mine = next((s for s in samples if s.gpu.uuid == self.gpu.uuid), None)
            if self.started is None and mine is not None and (mine.sm_metric or mine.dram_metric):
                self.started = mine
                self.memory_started = self._read_memory()
        status = tuple(self.sampler.status())
        if not self.statuses or self.statuses[-1] != status:
            self.statuses.append((str(status[0]), str(status[1])))
        return reply

    def _cupti(self) -> Any:
        if self._lib is not None:
            return self._lib
        try:
            return importlib.import_module("cupti")
        except ImportError:
            return None

    def _chip(self) -> str | None:
        # The chip name lives on the enabled Collector (cupti-python sets it in enable());
        # the sampler does not export it, so the check reads it where the sampler keeps it.
        for dev in getattr(self.sampler, "_devices", ()):
            chip = getattr(getattr(dev, "collector", None), "_chip_name", None)
            if isinstance(chip, str) and chip:
                return chip
        return None

    def report(self) -> dict[str, Any]:
        libs = mapped_libraries()
        started = self.started
        metrics = [m for m in ((started.sm_metric, started.dram_metric, started.activity_metric)
                               if started else ()) if m]
        cuda = getattr(self.sampler, "_cuda", None)
        return {
            "pid": os.getpid(),
            "own_process": self.own_process,
            "torch_imported": "torch" in sys.modules,
            "started": started is not None,
            "metrics": metrics,
            "metric_set": started.metric_set if started else None,
            "statuses": self.statuses,
            "retained_contexts": list(getattr(cuda, "retained", ()) or ()),
            "memory_before": self.memory_before,
            "memory_started": self.memory_started,
            "memory_now": self._read_memory(),
            "libcupti": {"mapped": libs,
                         "wheels": [distribution(n, libs)
                                    for n in ("nvidia-cuda-cupti", "cupti-python")]},
            "cupti": cupti_answers(self._cupti(), self._chip(), metrics),
        }


def nvml_process_memory(uuid: str) -> Callable[[], dict[str, Any]]:
    """A reader of this process's GPU memory as NVML lists it (compute processes)."""
    import pynvml

    pynvml.nvmlInit()  # reference-counted by NVML; the process ends with it held
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)

    def read() -> dict[str, Any]:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        listed = {int(p.pid): p.usedGpuMemory for p in procs}
        mine = listed.get(os.getpid())
        return {"pid": os.getpid(), "bytes": int(mine) if mine is not None else 0,
                "listed": mine is not None, "pids": sorted(listed)}

    return read


def serve(server: SamplerServer, stdin: IO[str], stdout: IO[str]) -> None:
    """Answer JSON-line requests until ``close`` or end of input."""
    for line in stdin:
        request = json.loads(line)
        stdout.write(json.dumps(server.handle(request), default=str) + "\n")
        stdout.flush()
        if request.get("cmd") == "close":
            return
    server.sampler.close()


def main(argv: list[str] | None = None) -> int:
    """The child: the agent's sampler on one GPU, no CUDA work of its own."""
    from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler

    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--uuid", required=True)
    ap.add_argument("--name", default="")
    ap.add_argument("--interval", type=float, default=0.02)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="sampler %(asctime)s %(levelname)s %(name)s: %(message)s")
    gpu = GPUIdentity(args.index, args.uuid, args.name)
    try:
        memory: Callable[[], dict[str, Any]] | None = nvml_process_memory(args.uuid)
    except Exception as exc:  # the memory rows say unknown; the sampler still runs
        log.warning("no NVML process memory for %s: %s", args.uuid, exc)
        memory = None
    server = SamplerServer(CuptiPmSampler([gpu], interval_s=args.interval), gpu, memory=memory,
                           own_process=True)
    serve(server, sys.stdin, sys.stdout)
    return 0


# --- the parent's side ---------------------------------------------------------------------

class _Client:
    """What both transports share: requests, the samples and the report."""

    def __init__(self, gpu: GPUIdentity) -> None:
        self.gpu = gpu

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def sample_profiling(self) -> list[ProfilingSample]:
        reply = self._request({"cmd": "sample"})
        if "error" in reply:
            raise error_from_json(reply["error"])
        return [sample_from_json(self.gpu, s) for s in reply["ok"]]

    def report(self) -> dict[str, Any]:
        try:
            reply = self._request({"cmd": "report"})
        except HardwareError as exc:
            return {"error": str(exc)}
        return dict(reply.get("ok") or {"error": reply.get("error")})


class LocalSampler(_Client):
    """The server in this process (the dry run), through the same JSON encoding."""

    def __init__(self, server: SamplerServer) -> None:
        super().__init__(server.gpu)
        self.server = server
        self._closed = False

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        reply: dict[str, Any] = json.loads(json.dumps(self.server.handle(request), default=str))
        return reply

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.server.handle({"cmd": "close"})


class SamplerProcess(_Client):
    """The server in a child process that never imports torch: the sidecar's situation."""

    def __init__(self, gpu: GPUIdentity, interval_s: float, log_path: Path | None = None,
                 python: str = sys.executable) -> None:
        super().__init__(gpu)
        env = dict(os.environ)
        # The child imports mrc_agent from wherever this process did (a checkout's
        # .ci/namespace included); cupti-python, and libcupti through cuda-pathfinder, come
        # from the interpreter's own site-packages.
        roots = [str(Path(p).parent) for p in importlib.import_module("mrc_agent").__path__
                 if Path(p).is_dir()]
        if roots:
            env["PYTHONPATH"] = os.pathsep.join(roots + [env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep)
        self._log = open(log_path, "a", encoding="utf-8") if log_path else None  # noqa: SIM115
        self._proc = subprocess.Popen(
            [python, "-m", MODULE, "--index", str(gpu.index), "--uuid", gpu.uuid,
             "--name", gpu.name, "--interval", repr(interval_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log if self._log is not None else None, text=True, env=env)
        self.pid = self._proc.pid

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        if proc.poll() is not None:
            raise HardwareError(f"the sampler process exited ({proc.returncode})")
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
        except OSError as exc:
            raise HardwareError(f"the sampler process is gone: {exc}") from exc
        ready, _, _ = select.select([proc.stdout], [], [], REPLY_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if not line:
            raise HardwareError(f"no answer from the sampler process to {request['cmd']!r}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._request({"cmd": "close"})
            except HardwareError as exc:
                log.warning("closing the sampler process: %s", exc)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()
        if self._log is not None:
            self._log.close()
            self._log = None


if __name__ == "__main__":
    sys.exit(main())
