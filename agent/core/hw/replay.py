"""Replay backend: plays a JSON Lines GPU trace at wall-clock pace, looping forever.

One object per device per sample (format in ``docs/replay-format.md``), after an optional
first line naming the format's version (none: version 1)::

    {"version": 2}
    {"t": 0.0, "gpu": 0, "uuid": "GPU-…", "name": "NVIDIA H200", "gpu_util": 0.93, ...}

Version 2 adds the hardware GPU-activity timeline: ``activity``, the ``[t, ratio]`` points
CUPTI PM sampling decoded since the row before, and ``activity_metric``, the metric they were
read from. Playback hands them to the profiling collector as the live sampler does.

Rows are keyed by ``uuid``: a GPU in MIG mode has a row of its own and one per MIG device
(``MIG-…`` UUID), all with the physical GPU's ``gpu`` index, as the NVML source reports them.
A trace without a ``uuid`` gets ``GPU-replay-<gpu>``, so one GPU per index, as before.
``t`` is seconds from the trace start. At agent time ``e`` after start the trace position is
``e mod period`` and each GPU shows its latest record at or before that position. Cumulative
counters keep growing across loops: each loop adds the trace's own increase plus one mean step,
so ``rate()`` stays continuous over the seam. The same field table drives ``mrc-agent record``.
"""

from __future__ import annotations

import bisect
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from mrc_agent.agent.core.hw.base import (
    DeviceSample,
    GpmSample,
    GPUIdentity,
    ProfilingSample,
    SourceUnavailable,
)
from mrc_agent.agent.core.hw.procfs import is_pid
from mrc_agent.exporters.files import describe, read_bounded

#: Trace field -> (sample kind, attribute, kind of value). Kinds of value: "ratio" (0-1),
#: "counter" (cumulative, non-decreasing), "gauge" (any non-negative number).
TRACE_FIELDS: dict[str, tuple[str, str, str]] = {
    "gpu_util": ("device", "gpu_util", "ratio"),
    "mem_util": ("device", "mem_util", "ratio"),
    "mem_used_bytes": ("device", "mem_used_bytes", "gauge"),
    "mem_total_bytes": ("device", "mem_total_bytes", "gauge"),
    "pcie_tx_bytes_per_second": ("device", "pcie_tx_bytes_per_second", "gauge"),
    "pcie_rx_bytes_per_second": ("device", "pcie_rx_bytes_per_second", "gauge"),
    "pcie_tx_bytes_total": ("device", "pcie_tx_bytes_total", "counter"),
    "pcie_rx_bytes_total": ("device", "pcie_rx_bytes_total", "counter"),
    "pcie_replays_total": ("device", "pcie_replays_total", "counter"),
    "nvlink_tx_bytes_total": ("device", "nvlink_tx_bytes_total", "counter"),
    "nvlink_rx_bytes_total": ("device", "nvlink_rx_bytes_total", "counter"),
    "power_watts": ("device", "power_watts", "gauge"),
    "sm_clock_hertz": ("device", "sm_clock_hertz", "gauge"),
    "temperature_celsius": ("device", "temperature_celsius", "gauge"),
    "ecc_corrected_total": ("device", "ecc_corrected_total", "counter"),
    "ecc_uncorrected_total": ("device", "ecc_uncorrected_total", "counter"),
    "xid_errors_total": ("device", "xid_errors_total", "counter"),
    "sm_util": ("gpm", "sm_util", "ratio"),
    "sm_occupancy": ("gpm", "sm_occupancy", "ratio"),
    "tensor_util": ("gpm", "tensor_util", "ratio"),
    "dram_bw_util": ("gpm", "dram_bw_util", "ratio"),
    "gpm_pcie_tx_bytes_per_second": ("gpm", "pcie_tx_bytes_per_second", "gauge"),
    "gpm_pcie_rx_bytes_per_second": ("gpm", "pcie_rx_bytes_per_second", "gauge"),
    "nvlink_tx_bytes_per_second": ("gpm", "nvlink_tx_bytes_per_second", "gauge"),
    "nvlink_rx_bytes_per_second": ("gpm", "nvlink_rx_bytes_per_second", "gauge"),
    "sm_instructions_executed_total": ("profiling", "sm_instructions_executed_total", "counter"),
    "dram_read_bytes_total": ("profiling", "dram_read_bytes_total", "counter"),
    "dram_read_throughput_ratio": ("profiling", "dram_read_throughput_ratio", "ratio"),
}

#: At most this many fine-grained utilisation (or activity) points are handed out per pass.
_MAX_UTIL_POINTS = 10_000
#: The newest version of the format this reader knows: 1, the rows alone; 2 adds ``activity``
#: and ``activity_metric``. Written by ``mrc-agent record`` on the trace's first line.
FORMAT_VERSION = 2
#: Points one row's ``activity`` may hold: ten seconds of PM sampling at 1 ms.
MAX_ACTIVITY_POINTS = 10_000


#: A trace is read whole and kept parsed in memory: 16 MiB is about 50,000 lines (8 GPUs at
#: 10 Hz for 10 minutes) and some 50 MB parsed, within the sidecar's memory limit. Longer
#: recordings are cut before they are replayed.
MAX_TRACE_BYTES = 16 << 20
#: GPU indices a trace may use (NVML counts a node's GPUs in the tens).
MAX_GPUS = 1024
#: Longest ``uuid``/``name``: NVML's are 40-odd and 96 characters.
MAX_LABEL_CHARS = 256
#: Entries of one record's ``processes`` (NVML lists the tens of processes of a busy GPU).
MAX_PROCESSES = 1024
#: GPU instance ids a MIG row may name (NVML numbers an H100/H200's up to 14).
MAX_GPU_INSTANCES = 1024


class ReplayFormatError(ValueError):
    """The trace is malformed; the message names the file, the line and the reason."""


@dataclass
class _GpuTrace:
    identity: GPUIdentity
    times: list[float] = field(default_factory=list)
    records: list[dict[str, float]] = field(default_factory=list)
    #: Per record, the optional ``processes``: GPU memory by PID.
    processes: list[dict[int, float]] = field(default_factory=list)
    loop_increment: dict[str, float] = field(default_factory=dict)
    last_counter: dict[str, float] = field(default_factory=dict)
    #: For a MIG device, the GPU instance its GPM was measured over (``gpu_instance``).
    gpu_instance: int | None = None
    #: The hardware activity timeline (version 2): point times, their 0-1 values, the metric.
    activity_times: list[float] = field(default_factory=list)
    activity_values: list[float] = field(default_factory=list)
    activity_metric: str | None = None


def _text(value: str) -> bool:
    """Whether ``value`` is Unicode text that encodes: JSON's ``\\ud800`` escapes decode to
    lone surrogates, which pass every string check and then fail UTF-8 encoding in every
    scrape that writes them as a label."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _number(value: Any) -> TypeGuard[float]:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _gpu_instance(obj: dict[str, Any], uuid: str, where: str) -> int | None:
    """The optional ``gpu_instance`` of a MIG row."""
    value = obj.get("gpu_instance")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not (
            0 <= value < MAX_GPU_INSTANCES):
        raise ReplayFormatError(f"{where}: 'gpu_instance' must be an integer "
                                f"0-{MAX_GPU_INSTANCES - 1}")
    if not uuid.startswith("MIG-"):
        raise ReplayFormatError(f"{where}: 'gpu_instance' is only for a MIG device "
                                f"(a 'MIG-' uuid), not {uuid!r}")
    return value


def load_trace(path: str) -> dict[str, _GpuTrace]:
    """Parse and validate a trace, keyed by UUID in order of first appearance; raises
    ReplayFormatError with ``path:line: reason``."""
    gpus: dict[str, _GpuTrace] = {}
    #: The whole GPU (not a MIG device) that holds each index.
    whole: dict[int, str] = {}
    version: int | None = None  # set by the first line: its own, or 1 for a row
    try:
        lines = read_bounded(path, MAX_TRACE_BYTES, "replay trace").decode("utf-8").splitlines()
    except OSError as exc:
        raise ReplayFormatError(f"{path}: cannot read replay trace: {describe(exc)}") from exc
    except UnicodeDecodeError as exc:
        raise ReplayFormatError(f"{path}: not UTF-8 text ({exc.reason})") from exc
    for lineno, line in enumerate(lines, 1):
        where = f"{path}:{lineno}"
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReplayFormatError(f"{where}: not valid JSON ({exc.msg})") from exc
        except RecursionError as exc:
            raise ReplayFormatError(f"{where}: nested too deeply") from exc
        except ValueError as exc:  # an integer literal longer than Python converts
            raise ReplayFormatError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise ReplayFormatError(f"{where}: expected a JSON object")
        if "version" in obj and "t" not in obj:
            if version is not None:
                raise ReplayFormatError(f"{where}: the 'version' line must be the first line")
            version = _version(obj["version"], where)
            continue
        version = version or 1
        t, gpu = obj.get("t"), obj.get("gpu")
        if not _number(t) or t < 0:
            raise ReplayFormatError(f"{where}: 't' must be a number >= 0")
        if not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu < MAX_GPUS:
            raise ReplayFormatError(f"{where}: 'gpu' must be an integer 0-{MAX_GPUS - 1}")
        uuid = obj.get("uuid", f"GPU-replay-{gpu}")
        name = obj.get("name", "replay")
        if not isinstance(uuid, str) or not isinstance(name, str):
            raise ReplayFormatError(f"{where}: 'uuid' and 'name' must be strings")
        if len(uuid) > MAX_LABEL_CHARS or len(name) > MAX_LABEL_CHARS:
            raise ReplayFormatError(f"{where}: 'uuid' and 'name' must be at most "
                                    f"{MAX_LABEL_CHARS} characters (they become labels)")
        for key, text in (("uuid", uuid), ("name", name)):
            if not _text(text):
                raise ReplayFormatError(f"{where}: {key!r} is not valid Unicode text (a lone "
                                        "surrogate escape such as \\ud800)")
        instance = _gpu_instance(obj, uuid, where)
        trace = gpus.get(uuid)
        if trace is None:
            # One whole GPU per index; only MIG devices share their parent's index.
            if not uuid.startswith("MIG-") and whole.setdefault(gpu, uuid) != uuid:
                raise ReplayFormatError(f"{where}: gpu {gpu} changed uuid to {uuid!r} (only "
                                        f"MIG devices share an index, with {whole[gpu]!r})")
            trace = gpus[uuid] = _GpuTrace(GPUIdentity(gpu, uuid, name), gpu_instance=instance)
        elif trace.identity.index != gpu:
            raise ReplayFormatError(f"{where}: uuid {uuid!r} moved from gpu "
                                    f"{trace.identity.index} to gpu {gpu}")
        elif instance is not None:
            if trace.gpu_instance is None:  # a recording names it once GPM has a window
                trace.gpu_instance = instance
            elif instance != trace.gpu_instance:
                raise ReplayFormatError(
                    f"{where}: uuid {uuid!r} changed gpu_instance to {instance}")
        if trace.times and t < trace.times[-1]:
            raise ReplayFormatError(f"{where}: 't' goes backwards for gpu {gpu} ({uuid!r})")
        record: dict[str, float] = {}
        for key, value in obj.items():
            spec = TRACE_FIELDS.get(key)
            if spec is None:
                continue  # more fields are allowed
            if not _number(value) or value < 0:
                raise ReplayFormatError(f"{where}: {key!r} must be a number >= 0")
            if spec[2] == "ratio" and value > 1:
                raise ReplayFormatError(f"{where}: {key!r} is a 0-1 ratio, got {value}")
            if spec[2] == "counter":
                prev = trace.last_counter.get(key)
                if prev is not None and value < prev:
                    raise ReplayFormatError(
                        f"{where}: counter {key!r} decreases ({prev} -> {value})")
                trace.last_counter[key] = float(value)
            record[key] = float(value)
        processes = _processes(obj.get("processes"), where)
        _activity(obj, trace, version, where)
        if trace.times and t == trace.times[-1]:
            # Keyed by UUID, a second row at one time would hide the first: which is the
            # device's reading is not said (a MIG row that forgot its ``MIG-`` uuid, say).
            raise ReplayFormatError(f"{where}: two rows for uuid {uuid!r} at t={t}")
        trace.times.append(float(t))
        trace.records.append(record)
        trace.processes.append(processes)
    if not gpus:
        raise ReplayFormatError(f"{path}: the trace holds no samples")
    for trace in gpus.values():
        _fill_loop_increments(trace)
    return gpus


def _version(value: Any, where: str) -> int:
    """The first line's format version: 1 up to :data:`FORMAT_VERSION`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ReplayFormatError(f"{where}: 'version' must be an integer >= 1")
    if value > FORMAT_VERSION:
        raise ReplayFormatError(f"{where}: trace format version {value} is newer than this "
                                f"mrc-agent reads (1-{FORMAT_VERSION}): upgrade mrc-agent")
    return value


def _activity(obj: dict[str, Any], trace: _GpuTrace, version: int, where: str) -> None:
    """A row's version-2 ``activity`` (``[[t, ratio], ...]``, times from the trace start,
    increasing over the device's rows) and ``activity_metric``, appended to ``trace``."""
    points, metric = obj.get("activity"), obj.get("activity_metric")
    if points is None and metric is None:
        return
    if version < 2:
        raise ReplayFormatError(f"{where}: 'activity' and 'activity_metric' are version 2 "
                                'fields: the trace needs the first line {"version": 2}')
    if metric is not None:
        if not isinstance(metric, str) or not metric or len(metric) > MAX_LABEL_CHARS or (
                not _text(metric)):
            raise ReplayFormatError(f"{where}: 'activity_metric' must be a metric name of 1-"
                                    f"{MAX_LABEL_CHARS} characters")
        if trace.activity_metric not in (None, metric):
            raise ReplayFormatError(f"{where}: uuid {trace.identity.uuid!r} changed "
                                    f"activity_metric to {metric!r}")
        trace.activity_metric = metric
    if points is None:
        return
    if trace.activity_metric is None:
        raise ReplayFormatError(f"{where}: 'activity' needs 'activity_metric' (the metric it "
                                "was read from) on this row or an earlier one of the device")
    if not isinstance(points, list) or len(points) > MAX_ACTIVITY_POINTS:
        raise ReplayFormatError(f"{where}: 'activity' must be a list of at most "
                                f"{MAX_ACTIVITY_POINTS} [t, ratio] points")
    times, values = trace.activity_times, trace.activity_values
    for point in points:
        if not (isinstance(point, list) and len(point) == 2 and all(map(_number, point))
                and point[0] >= 0 and 0 <= point[1] <= 1):
            raise ReplayFormatError(f"{where}: each 'activity' point must be [t >= 0, ratio "
                                    f"0-1], not {json.dumps(point)[:40]}")
        if times and point[0] <= times[-1]:
            raise ReplayFormatError(f"{where}: 'activity' times must increase over the "
                                    f"device's rows ({times[-1]} then {point[0]})")
        times.append(float(point[0]))
        values.append(float(point[1]))


def _processes(value: Any, where: str) -> dict[int, float]:
    """The optional ``processes`` field: ``{"PID": bytes}``, as NVML's process list."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_PROCESSES:
        raise ReplayFormatError(f"{where}: 'processes' must be an object of at most "
                                f"{MAX_PROCESSES} \"PID\": bytes entries")
    out: dict[int, float] = {}
    for pid, used in value.items():
        if not is_pid(pid):  # reads at most a PID's digits: a 5,000-digit key is no PID
            raise ReplayFormatError(f"{where}: 'processes' key {pid[:20]!r} is not a PID")
        if not _number(used) or used < 0:
            raise ReplayFormatError(f"{where}: 'processes' value for {pid} must be a number "
                                    ">= 0 (bytes)")
        out[int(pid)] = float(used)
    return out


def _fill_loop_increments(trace: _GpuTrace) -> None:
    counters = {k for k, spec in TRACE_FIELDS.items() if spec[2] == "counter"}
    for key in counters:
        values = [r[key] for r in trace.records if key in r]
        if not values:
            continue
        rise = values[-1] - values[0]
        step = rise / (len(values) - 1) if len(values) > 1 else 0.0
        trace.loop_increment[key] = rise + step


def _period(gpus: dict[str, _GpuTrace]) -> float:
    last = max(tr.times[-1] for tr in gpus.values())
    steps = sorted(
        b - a for tr in gpus.values() for a, b in zip(tr.times, tr.times[1:], strict=False) if b > a
    )
    step = steps[len(steps) // 2] if steps else 1.0
    return last + step


class ReplayBackend:
    """Implements DeviceSource, GpmSource and ProfilingSource from a trace file."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic,
                 start: float | None = None) -> None:
        """``start``: the moment on ``clock`` the trace's ``t`` = 0 plays at (default: once
        the trace is read), for a trace that must keep time with something else."""
        self.path = path
        self._gpus = load_trace(path)
        # By GPU index, a GPU before its MIG devices (the order of first appearance).
        self._order = sorted(self._gpus.values(), key=lambda tr: tr.identity.index)
        self._period = _period(self._gpus)
        self._clock = clock
        self._start = clock() if start is None else start
        # Last (loop, index) handed out as fine-grained utilisation, per device UUID.
        self._util_cursor: dict[str, tuple[int, int]] = {}
        kinds = {TRACE_FIELDS[k][0] for tr in self._gpus.values() for r in tr.records for k in r}
        if any(tr.activity_metric for tr in self._gpus.values()):
            kinds.add("profiling")
        self._has = kinds
        # Activity points handed out so far, counted over the loops, per device UUID.
        self._activity_cursor: dict[str, int] = {}

    @property
    def period(self) -> float:
        return self._period

    @property
    def identities(self) -> list[GPUIdentity]:
        return [tr.identity for tr in self._order]

    def _position(self, now: float) -> tuple[int, float]:
        elapsed = max(now - self._start, 0.0)
        loop = int(elapsed // self._period)
        return loop, elapsed - loop * self._period

    def _current(self, kind: str) -> list[tuple[_GpuTrace, dict[str, float]]]:
        loop, pos = self._position(self._clock())
        out = []
        for trace in self._order:
            idx, lp = bisect.bisect_right(trace.times, pos) - 1, loop
            if idx < 0:
                if loop == 0:
                    continue  # the GPU appears later in the recording: not there yet
                idx, lp = len(trace.times) - 1, loop - 1  # still the previous loop's last
            values: dict[str, float] = {}
            for key, value in trace.records[idx].items():
                spec = TRACE_FIELDS[key]
                if spec[0] != kind:
                    continue
                if spec[2] == "counter":
                    value += lp * trace.loop_increment.get(key, 0.0)
                values[spec[1]] = value
            out.append((trace, values))
        return out

    def _util_points(self, trace: _GpuTrace) -> list[tuple[float, float]]:
        loop, pos = self._position(self._clock())
        idx = max(bisect.bisect_right(trace.times, pos) - 1, 0)
        uuid = trace.identity.uuid
        last = self._util_cursor.get(uuid)
        self._util_cursor[uuid] = (loop, idx)
        n = len(trace.times)
        if last is None:
            steps = [(loop, idx)]
        else:
            flat_last = last[0] * n + last[1]
            flat_now = loop * n + idx
            first = max(flat_last + 1, flat_now - _MAX_UTIL_POINTS + 1)
            steps = [divmod(i, n) for i in range(first, flat_now + 1)]
        points = []
        for lp, i in steps:
            util = trace.records[i].get("gpu_util")
            if util is not None:
                points.append((self._start + lp * self._period + trace.times[i], util))
        return points

    def sample_devices(self) -> list[DeviceSample]:
        if "device" not in self._has:
            raise SourceUnavailable("not_in_trace", f"{self.path} has no NVML-level fields")
        out = []
        for trace, values in self._current("device"):
            sample = DeviceSample(gpu=trace.identity, **values)  # type: ignore[arg-type]
            sample.util_samples = self._util_points(trace)
            sample.process_memory_bytes = self._processes_now(trace)
            out.append(sample)
        return out

    def _processes_now(self, trace: _GpuTrace) -> dict[int, float]:
        """The ``processes`` of the record :meth:`_current` shows for this GPU."""
        _, pos = self._position(self._clock())
        idx = bisect.bisect_right(trace.times, pos) - 1  # -1: the previous loop's last
        return dict(trace.processes[idx])

    def sample_gpm(self) -> list[GpmSample]:
        if "gpm" not in self._has:
            raise SourceUnavailable("gpm_unsupported", f"{self.path} has no GPM fields")
        return [GpmSample(gpu=tr.identity, gpu_instance=tr.gpu_instance, **v)
                for tr, v in self._current("gpm") if v]

    def sample_profiling(self) -> list[ProfilingSample]:
        if "profiling" not in self._has:
            raise SourceUnavailable(
                "not_in_trace", f"{self.path} has no profiling-counter fields")
        return [ProfilingSample(gpu=tr.identity, activity_points=self._activity_points(tr),
                                activity_metric=tr.activity_metric,
                                **v)  # type: ignore[arg-type]  # numeric only
                for tr, v in self._current("profiling") if v or tr.activity_metric]

    def _activity_points(self, trace: _GpuTrace) -> tuple[tuple[float, float], ...]:
        """The activity points the trace passed since the last call (since the start on the
        first), on this backend's clock, oldest first; at most :data:`_MAX_UTIL_POINTS`."""
        times = trace.activity_times
        n = len(times)
        if not n:
            return ()
        loop, pos = self._position(self._clock())
        now = loop * n + bisect.bisect_right(times, pos)
        first = max(self._activity_cursor.get(trace.identity.uuid, 0), now - _MAX_UTIL_POINTS)
        self._activity_cursor[trace.identity.uuid] = now
        values = trace.activity_values
        return tuple((self._start + lp * self._period + times[i], values[i])
                     for lp, i in (divmod(k, n) for k in range(first, now)))

    def close(self) -> None:
        """Nothing to release: the trace was read whole when the backend was made."""
