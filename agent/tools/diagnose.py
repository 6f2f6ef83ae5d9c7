"""``mrc-agent diagnose``: one window, three views of a target, and a verdict.

Over the same window this module runs

* ``py-spy record`` of the target twice at once, both ``--nonblocking`` (the target is never
  paused, so two readers do not fight over ptrace): an interactive flame graph
  (``flamegraph.svg``) for people and raw collapsed stacks per thread (``stacks.txt``,
  ``--threads --function``: one line per distinct stack, frames keyed by function and the
  function's first line) from which the top functions are computed;
* the agent's own collectors (process, gpu, gpm, profiling where available, derived) in-process
  at ``interval`` for the target alone, saved as ``samples.jsonl`` (every sample of every
  pass) and ``golden_triangle.csv`` (one row per pass and GPU);
* the GPU idle windows, from the derived collector's :class:`IdleTracker` fed with the finest
  utilisation points the GPU source gives.

It then decides a verdict (see :func:`decide`) and writes ``report.json`` and ``report.txt``.
The same :func:`diagnose` runs behind the CLI and behind the on-alert captures of
:mod:`agent.tools.capture`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from agent.core.catalog import CATALOG
from agent.core.collectors.base import Collector, SampleContext
from agent.core.collectors.derived import IdleTracker, Thresholds
from agent.core.config import AgentConfig, ConfigError
from agent.core.hw.base import GPUIdentity, SourceUnavailable
from agent.core.hw.procfs import ProcFS
from agent.core.runner import Runner
from agent.core.targets import TargetResolver
from exporters.exposition.snapshot import HistogramValue, Sample, Snapshot

log = logging.getLogger(__name__)

EXIT_OK, EXIT_PY_SPY = 0, 1
MIN_DURATION, MAX_DURATION = 1.0, 600.0
#: py-spy's default rate. 100 Hz over 10 s is 1000 stacks: enough to rank functions, and cheap
#: for the target under --nonblocking.
PY_SPY_RATE = 100

VERDICTS = ("preprocessing-bound", "cpu-bound", "transfer-bound", "memory-bound", "healthy")

#: The files of one diagnosis, in the order report.txt lists them.
FILES = {
    "flamegraph": "flamegraph.svg",
    "stacks": "stacks.txt",
    "samples": "samples.jsonl",
    "golden_triangle": "golden_triangle.csv",
    "report_json": "report.json",
    "report_txt": "report.txt",
}

#: Function names of CPU-side image work: decoding, resizing, colour conversion, tensor
#: conversion and normalisation, whatever library does it (PIL, OpenCV, kornia, torchvision,
#: hand-written). Matched case-insensitively anywhere in the qualified name.
IMAGE_FUNCTION = re.compile(
    r"resiz|decod|draft|thumbnail|convert|to_?tensor|normali[sz]|preprocess|interpolat|"
    r"imread|imdecode|jpe?g|png|webp|crop|rescale|warp_?affine|image|img|pixel",
    re.IGNORECASE)
#: Files of image libraries, and modules named like image or preprocessing code.
IMAGE_FILE = re.compile(
    r"(^|/)(PIL|cv2|kornia|torchvision|imageio|skimage|simplejpeg|turbojpeg|pyvips|"
    r"albumentations)(/|\.|$)|(^|/)[^/]*(preprocess|image|img|decod|resiz)[^/]*\.py$",
    re.IGNORECASE)


@dataclass(frozen=True)
class Rules:
    """Where the verdict's lines are drawn, and why.

    ``image_share`` 0.5: image code must be on the busy thread's stack in most of its samples,
    not just show up. ``gpu_idle_fraction`` 0.5: "mostly idle" is idle (at or below the agent's
    idle threshold) in more than half of the fine-grained utilisation points; a mean would put
    a GPU bursting at 97 % for a fifth of the time right on the agent's 0.2 starvation line.
    ``gpu_waiting_util`` 0.5: the alerts' "busy" line (alerts/config.py ``gpu_busy_ratio``);
    below it the GPU waits for something. ``pcie_busy`` 20 GB/s per direction is ~60 % of a PCIe
    Gen4 x16 link and ~30 % of Gen5; an MRC service moves a few GB/s of images, so more,
    sustained, means the link paces the work. ``nvlink_busy`` 225 GB/s per direction is half of
    H100/H200 NVLink (450 GB/s). ``instructions_per_byte`` 8 and ``gpm_sm_to_dram`` 1.2 are the
    alerts' memory-bound lines (alerts/config.py): the roofline ridge on Hopper, and its GPM
    activity stand-in.
    """

    image_share: float = 0.5
    gpu_idle_fraction: float = 0.5
    gpu_waiting_util: float = 0.5
    pcie_busy_bytes_per_second: float = 20e9
    nvlink_busy_bytes_per_second: float = 225e9
    instructions_per_byte: float = 8.0
    gpm_sm_to_dram: float = 1.2


class PySpyError(Exception):
    """py-spy is missing or cannot attach; ``reason`` is a short code
    (``missing``, ``permission``, ``not_python``, ``failed``), the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# -- py-spy ------------------------------------------------------------------------------------
def find_py_spy(explicit: str | None = None) -> str:
    """The py-spy executable: ``explicit``, else the one installed beside this Python (the
    ``diagnose`` extra), else the first on ``PATH``. Raises PySpyError('missing')."""
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise PySpyError("missing", f"py-spy not found at {explicit}")
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("py-spy")
    if found is None:
        raise PySpyError("missing", "py-spy is not installed (pip install 'mrc-agent[diagnose]' "
                                    "or pip install py-spy)")
    return found


def _ptrace_hint(pid: int) -> str:
    try:
        from agent.tools.doctor import ptrace_ok

        return ptrace_ok(pid, ProcFS())[1]
    except Exception as exc:  # the hint is best effort; the error itself stands
        log.debug("ptrace check failed: %s", exc)
        return "ptrace permission unknown"


def explain_failure(pid: int, stderr: str) -> PySpyError:
    """Turn py-spy's stderr into a PySpyError that says why and what to do."""
    text = stderr.strip()
    first = next((ln.strip() for ln in text.splitlines()
                  if ln.strip() and not ln.startswith("py-spy>")), "no output")
    if re.search(r"permission denied|operation not permitted|EPERM", text, re.IGNORECASE):
        return PySpyError(
            "permission",
            f"py-spy cannot attach to pid {pid}: permission denied ({_ptrace_hint(pid)}). "
            "Run as root or as the target's user with kernel.yama.ptrace_scope=0; in "
            "Kubernetes the pod needs CAP_SYS_PTRACE (securityContext.capabilities.add: "
            "[SYS_PTRACE]) and shareProcessNamespace: true")
    if "python version" in text or "executable name" in text:
        return PySpyError("not_python", f"py-spy cannot read pid {pid} as a Python process "
                                        f"(py-spy: {first})")
    return PySpyError("failed", f"py-spy failed on pid {pid}: {first}")


class PySpy:
    """Two ``py-spy record`` children over one window: the SVG and the raw stacks.

    py-spy's ``--duration`` is whole seconds, so the children get a cap a little past the
    window and are stopped with SIGINT (on which py-spy writes its output) when it ends.
    """

    def __init__(self, exe: str, pid: int, svg: str, raw: str, duration: float,
                 rate: int = PY_SPY_RATE) -> None:
        self.pid = pid
        self.svg, self.raw = svg, raw
        cap = str(math.ceil(duration) + 2)
        common = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--duration", cap,
                  "--nonblocking"]
        self._errs: list[IO[bytes]] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        for extra in (["--format", "flamegraph", "-o", svg],
                      ["--format", "raw", "--threads", "--function", "-o", raw]):
            # Closed in stop() or kill(): it must outlive this constructor.
            err = tempfile.TemporaryFile()  # noqa: SIM115
            self._errs.append(err)
            self._procs.append(subprocess.Popen(common + extra, stdin=subprocess.DEVNULL,
                                                stdout=subprocess.DEVNULL, stderr=err))

    def _stderr(self, i: int) -> str:
        err = self._errs[i]
        err.seek(0)
        return err.read(64 * 1024).decode("utf-8", "replace")

    def failed_early(self) -> bool:
        """A child already exited with an error (it could not attach)."""
        return any(p.poll() not in (None, 0) for p in self._procs)

    def stop(self, timeout: float = 15.0) -> None:
        """End the window: SIGINT, wait for the files; raises PySpyError if py-spy failed."""
        for p in self._procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self._procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        try:
            svg_rc, raw_rc = (p.returncode for p in self._procs)
            svg_err, raw_err = self._stderr(0), self._stderr(1)
        finally:
            for err in self._errs:
                err.close()
        if raw_rc != 0 or not os.path.exists(self.raw):
            raise explain_failure(self.pid, raw_err or svg_err)
        if svg_rc != 0 or not _is_svg(self.svg):
            if "No stack counts" in svg_err or os.path.getsize(self.raw) == 0:
                # No Python code ran during the window: py-spy writes no flame graph then.
                _write_empty_svg(self.svg)
            else:
                raise explain_failure(self.pid, svg_err)

    def kill(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for err in self._errs:
            err.close()


def _is_svg(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return b"<svg" in head and os.path.getsize(path) > 1024


def _write_empty_svg(path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write('<?xml version="1.0" standalone="no"?>\n'
                '<svg version="1.1" width="640" height="60" xmlns="http://www.w3.org/2000/svg">'
                '<text x="10" y="35" font-family="monospace" font-size="14">No samples: the '
                'target ran no Python code during the window (idle).</text></svg>\n')


# -- collapsed stacks ------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int | None

    @property
    def key(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        return f"{self.function} ({where})" if where else self.function


@dataclass(frozen=True)
class Stack:
    thread: str
    frames: tuple[Frame, ...]  # outermost first
    count: int


_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse_frame(text: str) -> Frame:
    m = _FRAME.match(text)
    if m is None:
        return Frame(text, "", None)
    line = m.group("line")
    return Frame(m.group("fn"), m.group("file"), int(line) if line else None)


def _thread_label(head: str) -> str:
    """``thread (123): MainThread`` -> ``MainThread (123)``; ``thread (0x7f…)`` as is."""
    m = re.match(r"^thread \((?P<tid>[^)]*)\)(?::\s*(?P<name>.*))?$", head)
    if m is None:
        return head
    tid, name = m.group("tid"), m.group("name")
    return f"{name} ({tid})" if name else f"thread {tid}"


def parse_collapsed(text: str) -> list[Stack]:
    """py-spy's raw output: ``[thread (TID): NAME;]frame;frame;... COUNT`` per line."""
    out: list[Stack] = []
    for line in text.splitlines():
        body, _, count = line.rstrip().rpartition(" ")
        if not body or not count.isdigit():
            continue
        parts = body.split(";")
        thread = "all threads"
        while parts and parts[0].startswith(("thread (", "process (")):
            head = parts.pop(0)
            if head.startswith("thread ("):
                thread = _thread_label(head)
        out.append(Stack(thread, tuple(parse_frame(p) for p in parts), int(count)))
    return out


def thread_samples(stacks: Iterable[Stack]) -> Counter[str]:
    totals: Counter[str] = Counter()
    for s in stacks:
        totals[s.thread] += s.count
    return totals


def top_functions(stacks: Sequence[Stack], limit: int = 10,
                  rate: float = PY_SPY_RATE) -> dict[str, list[dict[str, Any]]]:
    """Top functions by self time (leaf frame) and by total, inclusive time (anywhere on the
    stack, counted once per stack), keyed by function and file:line."""
    total_samples = sum(s.count for s in stacks) or 1
    self_c: Counter[str] = Counter()
    total_c: Counter[str] = Counter()
    frames: dict[str, Frame] = {}
    for s in stacks:
        if not s.frames:
            continue
        leaf = s.frames[-1]
        frames[leaf.key] = leaf
        self_c[leaf.key] += s.count
        for key in {f.key for f in s.frames}:
            total_c[key] += s.count
        for f in s.frames:
            frames.setdefault(f.key, f)

    def row(key: str) -> dict[str, Any]:
        f = frames[key]
        return {"function": f.function, "file": f.file, "line": f.line, "frame": key,
                "self_samples": self_c[key], "total_samples": total_c[key],
                "self_ratio": round(self_c[key] / total_samples, 4),
                "total_ratio": round(total_c[key] / total_samples, 4),
                "self_seconds": round(self_c[key] / rate, 3),
                "total_seconds": round(total_c[key] / rate, 3)}

    by_self = sorted(self_c, key=lambda k: (-self_c[k], -total_c[k], k))[:limit]
    by_total = sorted(total_c, key=lambda k: (-total_c[k], -self_c[k], k))[:limit]
    return {"self": [row(k) for k in by_self], "total": [row(k) for k in by_total]}


def is_image_frame(frame: Frame) -> bool:
    return bool(IMAGE_FUNCTION.search(frame.function) or IMAGE_FILE.search(frame.file))


def image_share(stacks: Sequence[Stack]) -> tuple[float, list[tuple[str, int]]]:
    """Share of samples with image code on the stack, and the commonest image frames (the
    innermost matching frame of each stack)."""
    total = sum(s.count for s in stacks)
    hits = 0
    where: Counter[str] = Counter()
    for s in stacks:
        match = next((f for f in reversed(s.frames) if is_image_frame(f)), None)
        if match is not None:
            hits += s.count
            where[match.key] += s.count
    return (hits / total if total else 0.0), where.most_common(5)


# -- in-process sampling -----------------------------------------------------------------------
class _WindowTracker(IdleTracker):
    """The derived collector's idle tracker, also keeping each completed window and the points."""

    def __init__(self, threshold: float) -> None:
        super().__init__(threshold)
        self.windows: list[tuple[float, float]] = []
        self.points: list[tuple[float, float]] = []

    def feed(self, points: list[tuple[float, float]]) -> None:
        for t, util in points:
            if self.last_t is not None and t <= self.last_t:
                continue
            self.points.append((t, util))
            since = self.idle_since
            super().feed([(t, util)])
            if since is not None and self.idle_since is None:
                self.windows.append((since, t))


class IdleWindows:
    """A collector that only watches: GPU idle windows from the finest utilisation points of
    the pass (left in the context by the gpu collector), from ``start`` on."""

    name = "idle_windows"

    def __init__(self, threshold: float, start: float) -> None:
        self.threshold = threshold
        self.start = start
        self.trackers: dict[GPUIdentity, _WindowTracker] = {}

    def update(self, ctx: SampleContext) -> list[Sample]:
        for gpu, points in ctx.gpu_util_points.items():
            tracker = self.trackers.setdefault(gpu, _WindowTracker(self.threshold))
            tracker.feed([p for p in points if p[0] >= self.start])
        return []


class _Watched:
    """Keeps the reason a collector gave for having no data, for the report."""

    def __init__(self, inner: Collector) -> None:
        self.inner = inner
        self.name = inner.name
        self.reason = ""

    def update(self, ctx: SampleContext) -> list[Sample]:
        try:
            out = self.inner.update(ctx)
        except SourceUnavailable as exc:
            self.reason = exc.detail or exc.reason
            raise
        except Exception as exc:
            self.reason = f"{type(exc).__name__}: {exc}"
            raise
        self.reason = ""
        return out


class Borrowed:
    """Samples taken from another sampler's latest snapshot (the running agent's profiling
    counters: one CUPTI session per process, so a capture reads the agent's)."""

    def __init__(self, name: str, source: Callable[[], Snapshot], metrics: set[str]) -> None:
        self.name = name
        self._source = source
        self._metrics = metrics

    def update(self, ctx: SampleContext) -> list[Sample]:
        out = [s for s in self._source().samples if s[0] in self._metrics]
        if not out:
            raise SourceUnavailable("not_sampled", "the agent's sampler has no such samples")
        return out


def runnable(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]],
             seconds: float) -> dict[str, float] | None:
    """The hottest thread's share of the window spent running or ready to run.

    User CPU alone undercounts a thread on a node short of CPU: it wants a whole core but is
    granted less. Time on the run queue is demand too, so a thread runnable ~100 % of the
    window is CPU-bound whatever the node gave it. A thread born in the window counts from
    zero."""
    if not after or seconds <= 0:
        return None
    best = (0.0, 0.0)
    for tid, (cpu, wait) in after.items():
        cpu0, wait0 = before.get(tid, (0, 0))
        d_cpu, d_wait = max(cpu - cpu0, 0) / 1e9, max(wait - wait0, 0) / 1e9
        if d_cpu + d_wait > sum(best):
            best = (d_cpu, d_wait)
    return {"runnable_ratio": min((best[0] + best[1]) / seconds, 1.0),
            "on_cpu_ratio": min(best[0] / seconds, 1.0),
            "waiting_ratio": min(best[1] / seconds, 1.0)}


# -- analysis ----------------------------------------------------------------------------------
_LABELS = {s.name: s.labels for s in CATALOG}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _values(snaps: Sequence[Snapshot], name: str,
            match: Callable[[tuple[str, ...]], bool]) -> list[tuple[float, tuple[str, ...], float]]:
    out = []
    for snap in snaps:
        for n, labels, value in snap.samples:
            if n == name and isinstance(value, (int, float)) and match(labels):
                out.append((snap.timestamp, labels, float(value)))
    return out


def _per_gpu_mean(snaps: Sequence[Snapshot], name: str,
                  gpus: set[tuple[str, ...]]) -> dict[tuple[str, ...], float]:
    acc: dict[tuple[str, ...], list[float]] = {}
    for _, labels, v in _values(snaps, name, lambda ls: ls[:3] in gpus):
        acc.setdefault(labels[:3], []).append(v)
    return {g: sum(vs) / len(vs) for g, vs in acc.items()}


def _per_gpu_rate(snaps: Sequence[Snapshot], name: str,
                  gpus: set[tuple[str, ...]]) -> dict[tuple[str, ...], float]:
    """Increase of a cumulative counter per second over the window, per GPU."""
    seen: dict[tuple[str, ...], list[tuple[float, float]]] = {}
    for t, labels, v in _values(snaps, name, lambda ls: len(ls) == 3 and ls in gpus):
        seen.setdefault(labels, []).append((t, v))
    out = {}
    for g, points in seen.items():
        (t0, v0), (t1, v1) = points[0], points[-1]
        if t1 > t0 and v1 >= v0:
            out[g] = (v1 - v0) / (t1 - t0)
    return out


def _per_gpu_delta(snaps: Sequence[Snapshot], name: str,
                   gpus: set[tuple[str, ...]]) -> dict[tuple[str, ...], float]:
    seen: dict[tuple[str, ...], list[float]] = {}
    for _, labels, v in _values(snaps, name, lambda ls: ls[:3] in gpus):
        seen.setdefault(labels[:3], []).append(v)
    return {g: vs[-1] - vs[0] for g, vs in seen.items() if len(vs) > 1}



def analyse_gpu(snaps: Sequence[Snapshot], pid: int, idle: IdleWindows | None,
                reasons: dict[str, str], start: float) -> dict[str, Any]:
    """What the GPU did over the window, for the GPUs the target uses (all when none is
    attributed to it)."""
    all_gpus = {labels[:3] for _, labels, _ in _values(
        snaps, "mrc_gpu_utilization_ratio", lambda ls: True)}
    if not all_gpus:
        reason = reasons.get("gpu") or "no GPU utilisation samples"
        return {"available": False, "reason": reason}
    mine = {labels[:3] for _, labels, _ in _values(
        snaps, "mrc_gpu_process_memory_used_bytes", lambda ls: ls[3] == str(pid))}
    gpus = mine or all_gpus
    util_mean = _per_gpu_mean(snaps, "mrc_gpu_utilization_ratio", gpus)
    per_gpu: dict[str, dict[str, Any]] = {}
    idle_fraction: dict[tuple[str, ...], float] = {}
    windows: list[dict[str, Any]] = []
    trackers: dict[tuple[str, ...], _WindowTracker] = (
        {} if idle is None else {gid.labels: t for gid, t in idle.trackers.items()})
    threshold = Thresholds.idle_util if idle is None else idle.threshold
    for g in sorted(gpus):
        tracker = trackers.get(g)
        points = tracker.points if tracker else []
        if points:
            fine_mean = sum(u for _, u in points) / len(points)
            idle_fraction[g] = sum(1 for _, u in points if u <= threshold) / len(points)
        else:  # no fine-grained points: the per-pass readings stand in
            fine_mean = util_mean.get(g, 0.0)
            idle_fraction[g] = 1.0 if fine_mean <= threshold else 0.0
        if tracker:
            for a, b in tracker.windows:
                windows.append({"gpu": g[0], "start_seconds": round(a - start, 3),
                                "end_seconds": round(b - start, 3),
                                "duration_seconds": round(b - a, 3)})
            if tracker.idle_since is not None and points:
                end = points[-1][0]
                windows.append({"gpu": g[0], "start_seconds": round(tracker.idle_since - start, 3),
                                "end_seconds": round(end - start, 3),
                                "duration_seconds": round(end - tracker.idle_since, 3),
                                "open": True})
        per_gpu[g[0]] = {"uuid": g[1], "model": g[2], "utilization_mean": _r(fine_mean),
                         "idle_fraction": _r(idle_fraction[g]), "utilization_points": len(points)}
    pcie = {}
    for direction in ("tx", "rx"):
        nvml = _per_gpu_mean(snaps, f"mrc_gpu_pcie_{direction}_bytes_per_second", gpus)
        gpm = _per_gpu_mean(snaps, f"mrc_gpu_gpm_pcie_{direction}_bytes_per_second", gpus)
        pcie[direction] = {**gpm, **nvml}
    nvlink = {}
    for direction in ("tx", "rx"):
        gpm = _per_gpu_mean(snaps, f"mrc_gpu_gpm_nvlink_{direction}_bytes_per_second", gpus)
        counted = _per_gpu_rate(snaps, f"mrc_gpu_nvlink_{direction}_bytes_total", gpus)
        nvlink[direction] = {**counted, **gpm}
    sm_active = _per_gpu_mean(snaps, "mrc_gpu_sm_active_ratio", gpus)
    dram_bw = _per_gpu_mean(snaps, "mrc_gpu_dram_bandwidth_utilization_ratio", gpus)
    proxy = _per_gpu_mean(snaps, "mrc_gpu_gpm_sm_to_dram_activity", gpus)
    inst = _per_gpu_delta(snaps, "mrc_gpu_sm_instructions_executed_total", gpus)
    dram = _per_gpu_delta(snaps, "mrc_gpu_dram_read_bytes_total", gpus)
    inst_per_byte = {g: inst[g] / dram[g] for g in inst if dram.get(g, 0) > 0}
    for g in gpus:
        row = per_gpu[g[0]]
        row["pcie_tx_bytes_per_second"] = _r(pcie["tx"].get(g), 0)
        row["pcie_rx_bytes_per_second"] = _r(pcie["rx"].get(g), 0)
        row["nvlink_tx_bytes_per_second"] = _r(nvlink["tx"].get(g), 0)
        row["nvlink_rx_bytes_per_second"] = _r(nvlink["rx"].get(g), 0)
        row["sm_active_mean"] = _r(sm_active.get(g))
        row["dram_bandwidth_utilization_mean"] = _r(dram_bw.get(g))
        row["gpm_sm_to_dram_activity_mean"] = _r(proxy.get(g))
        row["sm_instructions_per_dram_byte"] = _r(inst_per_byte.get(g), 3)
    starved = [v for _, _, v in _values(snaps, "mrc_gpu_starved", lambda ls: ls[0] == str(pid))]

    def worst(d: dict[tuple[str, ...], float], pick: Callable[..., float]) -> float | None:
        vals = [v for g, v in d.items() if g in gpus]
        return pick(vals) if vals else None

    if inst_per_byte:
        source = "cupti_pm_sampling"
    elif proxy or dram_bw:
        source = "gpm_activity_proxy"
    else:
        source = "none"
    return {
        "available": True,
        "gpus": per_gpu,
        "attributed": bool(mine),
        # The least idle of the target's GPUs decides, like the starvation signal.
        "idle_fraction": _r(min(idle_fraction.values())),
        "utilization_mean": _r(max(r["utilization_mean"] or 0.0 for r in per_gpu.values())),
        "idle_windows": windows,
        "starved_fraction": _r(_mean(starved)),
        "pcie_bytes_per_second": _r(worst({g: max(pcie["tx"].get(g, 0.0), pcie["rx"].get(g, 0.0))
                                           for g in gpus if g in pcie["tx"] or g in pcie["rx"]},
                                          max), 0),
        "nvlink_bytes_per_second": _r(worst(
            {g: max(nvlink["tx"].get(g, 0.0), nvlink["rx"].get(g, 0.0))
             for g in gpus if g in nvlink["tx"] or g in nvlink["rx"]}, max), 0),
        "sm_active_mean": _r(worst(sm_active, max)),
        "compute_memory": {
            "source": source,
            "sm_instructions_per_dram_byte": _r(worst(inst_per_byte, min), 3),
            "gpm_sm_to_dram_activity": _r(worst(proxy, min)),
            "dram_bandwidth_utilization": _r(worst(dram_bw, max)),
            "profiling_reason": reasons.get("profiling", ""),
        },
    }


def analyse_cpu(snaps: Sequence[Snapshot], pid: int, threshold: float,
                hottest_runnable: dict[str, float] | None = None) -> dict[str, Any]:
    """Mean user CPU of the process and of its hottest thread over the window; hot when either,
    or the hottest thread's runnable share (see :func:`runnable`), reaches ``threshold``."""

    def mine(ls: tuple[str, ...]) -> bool:
        return ls[0] == str(pid)

    user = [v for _, _, v in _values(snaps, "mrc_process_cpu_user_ratio", mine)]
    system = [v for _, _, v in _values(snaps, "mrc_process_cpu_system_ratio", mine)]
    hottest = [v for _, _, v in _values(snaps, "mrc_process_hottest_thread_cpu_user_ratio", mine)]
    names = [ls[1] for _, ls, _ in _values(snaps, "mrc_process_threads", mine)]
    u, h = _mean(user), _mean(hottest)
    peak = max(u or 0.0, h or 0.0)
    run = hottest_runnable or {}
    hot = (bool(user) and peak >= threshold) or run.get("runnable_ratio", 0.0) >= threshold
    return {"process": names[-1] if names else "", "user_ratio_mean": _r(u),
            "system_ratio_mean": _r(_mean(system)), "hottest_thread_user_ratio_mean": _r(h),
            "hottest_thread_runnable_ratio": _r(run.get("runnable_ratio")),
            "hottest_thread_waiting_ratio": _r(run.get("waiting_ratio")),
            "threshold": threshold, "hot": hot, "windows": len(user)}


@dataclass
class Verdict:
    verdict: str
    summary: str
    evidence: list[str] = field(default_factory=list)


def _gb(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e9:.2f} GB/s"


def decide(cpu: dict[str, Any], gpu: dict[str, Any], stacks: dict[str, Any],
           rules: Rules = Rules()) -> Verdict:
    """The verdict, first match wins:

    1. ``preprocessing-bound``: target CPU hot (user CPU of the process or of its hottest
       thread, or the hottest thread's runnable share of the window, at or above the
       starvation CPU threshold), the GPU mostly idle or not measured, and image code
       (decode/resize/convert…) on the busy thread's stack in most samples;
    2. ``cpu-bound``: the same, but the stacks are not image code;
    3. ``transfer-bound``: PCIe or NVLink busy while the GPU waits (utilisation or SM activity
       below the busy line);
    4. ``memory-bound``: the GPU is not mostly idle and computes few instructions per DRAM byte
       (profiling counters), or, without them, the GPM activity proxy says so (named as such);
    5. ``healthy``: none of these.
    """
    ev: list[str] = []
    cpu_line = (f"target CPU: user {cpu['user_ratio_mean']} cores, hottest thread "
                f"{cpu['hottest_thread_user_ratio_mean']}")
    if cpu.get("hottest_thread_runnable_ratio") is not None:
        cpu_line += (f", hottest thread runnable {cpu['hottest_thread_runnable_ratio']} of the "
                     f"window (waiting for a CPU {cpu['hottest_thread_waiting_ratio']})")
    cpu_line += f" (hot at >= {cpu['threshold']})"
    ev.append(cpu_line + (" -> hot" if cpu["hot"] else " -> not hot"))
    share = stacks.get("image_share", 0.0)
    top = stacks["top_self"][0]["frame"] if stacks.get("top_self") else "none"
    if stacks.get("busy_thread_samples"):
        ev.append(f"stacks: {stacks['busy_thread_samples']} samples on the busiest thread, "
                  f"{stacks['busy_thread']}; top self frame {top}; image code on the stack in "
                  f"{share:.0%} of them (line {rules.image_share:.0%})")
    else:
        ev.append("stacks: no samples, the target ran no Python code in the window")
    if stacks.get("image_frames"):
        ev.append("image frames: " + ", ".join(f"{k} ({n})" for k, n in stacks["image_frames"]))
    gpu_idle = True
    if not gpu.get("available"):
        ev.append(f"no GPU data ({gpu.get('reason', 'unknown')}): judged from CPU and stacks "
                  "only")
    else:
        gpu_idle = (gpu["idle_fraction"] or 0.0) >= rules.gpu_idle_fraction
        windows = gpu["idle_windows"]
        longest = max((w["duration_seconds"] for w in windows), default=0.0)
        ev.append(f"GPU: idle {gpu['idle_fraction']:.0%} of the window (mostly idle at >= "
                  f"{rules.gpu_idle_fraction:.0%}), mean utilisation {gpu['utilization_mean']}, "
                  f"{len(windows)} idle windows, longest {longest:.2f} s"
                  + ("" if gpu["attributed"] else "; no GPU memory attributed to the target, "
                     "all GPUs considered"))
        if gpu.get("starved_fraction") is not None:
            ev.append(f"agent starvation signal on {gpu['starved_fraction']:.0%} of passes")
    if cpu["hot"] and gpu_idle:
        if share >= rules.image_share:
            return Verdict("preprocessing-bound",
                           f"CPU-side image preprocessing starves the GPU: {top}", ev)
        return Verdict("cpu-bound", f"CPU-bound outside image code: {top}", ev)
    if gpu.get("available"):
        util = gpu["utilization_mean"] or 0.0
        sm = gpu.get("sm_active_mean")
        waiting = util < rules.gpu_waiting_util or (sm is not None and sm < rules.gpu_waiting_util)
        pcie, nvlink = gpu.get("pcie_bytes_per_second"), gpu.get("nvlink_bytes_per_second")
        ev.append(f"transfers: PCIe {_gb(pcie)} (busy at {_gb(rules.pcie_busy_bytes_per_second)}),"
                  f" NVLink {_gb(nvlink)} (busy at {_gb(rules.nvlink_busy_bytes_per_second)}) "
                  f"per direction; GPU {'waiting' if waiting else 'busy'} (utilisation {util}, "
                  f"SM active {sm})")
        busy_link = ((pcie or 0.0) >= rules.pcie_busy_bytes_per_second
                     or (nvlink or 0.0) >= rules.nvlink_busy_bytes_per_second)
        if busy_link and waiting:
            return Verdict("transfer-bound", "the GPU waits on PCIe/NVLink transfers", ev)
        cm = gpu["compute_memory"]
        if cm["source"] == "cupti_pm_sampling":
            ipb = cm["sm_instructions_per_dram_byte"]
            ev.append(f"compute per memory (profiling counters): {ipb} SM instructions per DRAM "
                      f"byte (memory-bound below {rules.instructions_per_byte:g})")
            memory_bound = ipb is not None and ipb < rules.instructions_per_byte
        elif cm["source"] == "gpm_activity_proxy":
            q = cm["gpm_sm_to_dram_activity"]
            ev.append(f"compute per memory (GPM activity proxy, not an instruction count): SM "
                      f"activity / DRAM bandwidth utilisation {q} (memory-bound below "
                      f"{rules.gpm_sm_to_dram:g}); profiling counters: "
                      f"{cm['profiling_reason'] or 'not available'}")
            memory_bound = q is not None and q < rules.gpm_sm_to_dram
        else:
            ev.append("compute per memory: no profiling counters and no GPM data")
            memory_bound = False
        if memory_bound and not gpu_idle:
            how = ("profiling counters" if cm["source"] == "cupti_pm_sampling"
                   else "GPM activity proxy")
            return Verdict("memory-bound", f"GPU kernels are memory-bound ({how})", ev)
    return Verdict("healthy", "no bottleneck found in this window", ev)


# -- outputs -----------------------------------------------------------------------------------
def _jsonable(value: Any) -> Any:
    if isinstance(value, HistogramValue):
        return {"buckets": dict(zip((str(b) for b in value.bounds), value.counts, strict=True)),
                "count": value.total, "sum": value.sum}
    return value


def write_samples(path: str, snaps: Sequence[Snapshot], start_wall: float) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for snap in snaps:
            rows = [{"name": n, "labels": dict(zip(_LABELS.get(n, ()), labels, strict=False)),
                     "value": _jsonable(v)} for n, labels, v in snap.samples]
            f.write(json.dumps({"time": round(snap.timestamp, 4),
                                "elapsed_seconds": round(snap.timestamp - start_wall, 4),
                                "samples": rows}) + "\n")


CSV_COLUMNS = ("time", "elapsed_seconds", "pid", "cpu_user_ratio", "hottest_thread_cpu_user_ratio",
               "gpu", "gpu_utilization_ratio", "pcie_tx_bytes_per_second",
               "pcie_rx_bytes_per_second", "nvlink_tx_bytes_per_second",
               "nvlink_rx_bytes_per_second", "sm_active_ratio",
               "dram_bandwidth_utilization_ratio", "gpm_sm_to_dram_activity",
               "sm_instructions_per_dram_byte", "gpu_starved")


def write_golden_triangle(path: str, snaps: Sequence[Snapshot], pid: int,
                          start_wall: float) -> None:
    """One row per pass and GPU: the three corners side by side. Counter-based columns are the
    increase since the previous pass."""
    prev: dict[tuple[str, tuple[str, ...]], tuple[float, float]] = {}
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for snap in snaps:
            proc: dict[str, float] = {}
            gpu: dict[tuple[str, ...], dict[str, float]] = {}
            for n, labels, v in snap.samples:
                if not isinstance(v, (int, float)):
                    continue
                if n.startswith("mrc_process_") or n == "mrc_gpu_starved":
                    if labels and labels[0] == str(pid):
                        proc[n] = float(v)
                elif n.startswith("mrc_gpu_") and len(labels) == 3:
                    gpu.setdefault(labels, {})[n] = float(v)
            rates: dict[tuple[str, ...], dict[str, float]] = {}
            for g, vals in gpu.items():
                for n in ("mrc_gpu_nvlink_tx_bytes_total", "mrc_gpu_nvlink_rx_bytes_total",
                          "mrc_gpu_sm_instructions_executed_total",
                          "mrc_gpu_dram_read_bytes_total"):
                    if n in vals:
                        before = prev.get((n, g))
                        if before is not None and snap.timestamp > before[0]:
                            rates.setdefault(g, {})[n] = (vals[n] - before[1]) / (
                                snap.timestamp - before[0])
                        prev[(n, g)] = (snap.timestamp, vals[n])

            def fmt(v: float | None) -> str:
                return "" if v is None else f"{v:.6g}"

            base = [f"{snap.timestamp:.3f}", f"{snap.timestamp - start_wall:.3f}", str(pid),
                    fmt(proc.get("mrc_process_cpu_user_ratio")),
                    fmt(proc.get("mrc_process_hottest_thread_cpu_user_ratio"))]
            if not gpu:
                w.writerow(base + [""] * (len(CSV_COLUMNS) - len(base) - 1)
                           + [fmt(proc.get("mrc_gpu_starved"))])
            for g, vals in sorted(gpu.items()):
                r = rates.get(g, {})
                ipb = None
                if r.get("mrc_gpu_dram_read_bytes_total"):
                    ipb = (r.get("mrc_gpu_sm_instructions_executed_total", 0.0)
                           / r["mrc_gpu_dram_read_bytes_total"])
                w.writerow(base + [
                    g[0], fmt(vals.get("mrc_gpu_utilization_ratio")),
                    fmt(vals.get("mrc_gpu_pcie_tx_bytes_per_second")),
                    fmt(vals.get("mrc_gpu_pcie_rx_bytes_per_second")),
                    fmt(vals.get("mrc_gpu_gpm_nvlink_tx_bytes_per_second",
                                 r.get("mrc_gpu_nvlink_tx_bytes_total"))),
                    fmt(vals.get("mrc_gpu_gpm_nvlink_rx_bytes_per_second",
                                 r.get("mrc_gpu_nvlink_rx_bytes_total"))),
                    fmt(vals.get("mrc_gpu_sm_active_ratio")),
                    fmt(vals.get("mrc_gpu_dram_bandwidth_utilization_ratio")),
                    fmt(vals.get("mrc_gpu_gpm_sm_to_dram_activity")),
                    fmt(ipb), fmt(proc.get("mrc_gpu_starved"))])


def render_text(report: dict[str, Any]) -> str:
    lines = [f"mrc-agent diagnose: pid {report['pid']} ({report['cpu']['process'] or '?'}), "
             f"{report['window']['duration_seconds']:g} s from {report['window']['started']}",
             f"verdict: {report['verdict']} - {report['summary']}", "", "evidence:"]
    lines += [f"  - {e}" for e in report["evidence"]]
    lines += ["", "top functions (self time, busy thread):"]
    for row in report["top_functions"]["self"][:10]:
        lines.append(f"  {row['self_ratio']:6.1%} self {row['total_ratio']:6.1%} total  "
                     f"{row['frame']}")
    if not report["top_functions"]["self"]:
        lines.append("  (no samples: the target ran no Python code)")
    windows = report["gpu"].get("idle_windows") or []
    if windows:
        lines += ["", "GPU idle windows (seconds from the start):"]
        for w in windows[:10]:
            lines.append(f"  gpu {w['gpu']}: {w['start_seconds']:.2f}-{w['end_seconds']:.2f} "
                         f"({w['duration_seconds']:.2f} s{', open' if w.get('open') else ''})")
        if len(windows) > 10:
            lines.append(f"  ... {len(windows) - 10} more in report.json")
    lines += ["", "files:"] + [f"  {name}" for name in report["files"]]
    return "\n".join(lines) + "\n"


# -- the whole thing ---------------------------------------------------------------------------
@dataclass
class Diagnosis:
    out_dir: str
    report: dict[str, Any]

    @property
    def verdict(self) -> str:
        return str(self.report["verdict"])

    @property
    def files(self) -> list[str]:
        return list(self.report["files"])


def check_pid(pid: int) -> None:
    """ConfigError when there is no such process."""
    if pid <= 0 or not os.path.isdir(f"/proc/{pid}"):
        raise ConfigError(f"no process with pid {pid}")


def diagnose(
    cfg: AgentConfig,
    pid: int,
    out_dir: str,
    duration: float,
    interval: float = 0.2,
    *,
    py_spy: str | None = None,
    collectors: Sequence[str] = ("process", "gpu", "gpm", "profiling", "derived"),
    extra: Sequence[Collector] = (),
    cancel: threading.Event | None = None,
    rules: Rules = Rules(),
) -> Diagnosis:
    """Run py-spy and the collectors over one window on ``pid`` and write the report into
    ``out_dir``. Raises PySpyError (py-spy missing or cannot attach), ConfigError (no such
    process) and ReplayFormatError (bad replay trace)."""
    from agent.core.wiring import COLLECTOR_FACTORIES, make_sources

    check_pid(pid)
    exe = find_py_spy(py_spy)
    cancel = cancel or threading.Event()
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, v) for k, v in FILES.items()}
    sources = make_sources(cfg)
    try:
        start = time.monotonic()
        start_wall = time.time()
        idle = IdleWindows(cfg.idle_util_threshold, start)
        built: list[Collector] = [COLLECTOR_FACTORIES[n](cfg, sources) for n in collectors]
        # The derived collector reads what the others left in the context: it goes last.
        watched = [_Watched(c) for c in built if c.name != "derived"]
        tail = [_Watched(c) for c in built if c.name == "derived"]
        runner = Runner([*watched, *(_Watched(c) for c in extra), *tail, idle],
                        TargetResolver([pid]), interval)
        spy = PySpy(exe, pid, paths["flamegraph"], paths["stacks"], duration)
        sched_before, sched_t0 = ProcFS().thread_schedstat(pid), time.monotonic()
        snaps: list[Snapshot] = []
        try:
            tick = start
            while True:
                snaps.append(runner.sample_once())
                if spy.failed_early():
                    break
                tick += interval
                if tick - start > duration + 1e-6 or cancel.wait(max(tick - time.monotonic(), 0)):
                    break
        except KeyboardInterrupt:
            # Ctrl-C in a terminal: py-spy got it too and writes what it has; so do we.
            cancel.set()
        except BaseException:
            spy.kill()
            raise
        hottest_runnable = runnable(sched_before, ProcFS().thread_schedstat(pid),
                                    time.monotonic() - sched_t0)
        spy.stop()
    finally:
        sources.close()
    elapsed = time.monotonic() - start
    reasons = {w.name: w.reason for w in runner.collectors if isinstance(w, _Watched)}

    with open(paths["stacks"], encoding="utf-8", errors="replace") as f:
        stacks = parse_collapsed(f.read())
    threads = thread_samples(stacks)
    busy = threads.most_common(1)[0][0] if threads else ""
    busy_stacks = [s for s in stacks if s.thread == busy]
    share, image_frames = image_share(busy_stacks)
    top = top_functions(busy_stacks)
    stack_info = {
        "samples": sum(threads.values()), "rate_hz": PY_SPY_RATE,
        "threads": dict(threads.most_common()), "busy_thread": busy,
        "busy_thread_samples": threads.get(busy, 0),
        "image_share": round(share, 4), "image_frames": image_frames,
        "top_self": top["self"],
    }
    cpu = analyse_cpu(snaps, pid, cfg.starvation_cpu_threshold, hottest_runnable)
    gpu = analyse_gpu(snaps, pid, idle, reasons, start)
    verdict = decide(cpu, gpu, stack_info, rules)
    write_samples(paths["samples"], snaps, start_wall)
    write_golden_triangle(paths["golden_triangle"], snaps, pid, start_wall)
    report: dict[str, Any] = {
        "verdict": verdict.verdict,
        "summary": verdict.summary,
        "evidence": verdict.evidence,
        "pid": pid,
        "window": {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start_wall)),
                   "duration_seconds": round(elapsed, 3), "interval_seconds": interval,
                   "passes": len(snaps), "cancelled": cancel.is_set()},
        "cpu": cpu,
        "gpu": gpu,
        "stacks": {k: v for k, v in stack_info.items() if k != "top_self"},
        "top_functions": {"self": top["self"], "total": top["total"],
                          "all_threads": top_functions(stacks)["self"]},
        "thresholds": {"starvation_cpu": cfg.starvation_cpu_threshold,
                       "idle_util": cfg.idle_util_threshold, **dataclasses.asdict(rules)},
        "files": list(FILES.values()),
    }
    report["cpu"]["collector_reasons"] = {k: v for k, v in reasons.items() if v}
    with open(paths["report_json"], "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    with open(paths["report_txt"], "w", encoding="utf-8") as f:
        f.write(render_text(report))
    return Diagnosis(out_dir, report)


def run_diagnose_command(args: Any) -> int:
    """``mrc-agent diagnose``; bad input raises ConfigError (exit 2 in cli.py)."""
    from agent.core.config import load
    from agent.core.hw.replay import ReplayFormatError

    if not MIN_DURATION <= args.duration <= MAX_DURATION:
        raise ConfigError(f"--duration must be {MIN_DURATION:g}-{MAX_DURATION:g} seconds")
    if not 0.05 <= args.interval <= args.duration:
        raise ConfigError("--interval must be 0.05 seconds or more and at most --duration")
    cli = {"pids": [args.pid], "gpu_backend": args.gpu_backend, "interval": args.interval,
           "starvation_cpu_threshold": args.starvation_cpu_threshold,
           "idle_util_threshold": args.idle_util_threshold}
    cfg = load({k: v for k, v in cli.items() if v is not None}, config_path=args.config)
    check_pid(args.pid)
    out = args.out or f"mrc-diagnose-{args.pid}-{time.strftime('%Y%m%dT%H%M%S')}"
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = diagnose(cfg, args.pid, out, args.duration, args.interval, py_spy=args.py_spy)
    except ReplayFormatError as exc:
        raise ConfigError(str(exc)) from exc
    except PySpyError as exc:
        print(f"mrc-agent diagnose: error: {exc}", file=sys.stderr)
        return EXIT_PY_SPY
    sys.stdout.write(render_text(result.report))
    sys.stdout.write(f"\nwritten to {os.path.abspath(out)}\n")
    return EXIT_OK
