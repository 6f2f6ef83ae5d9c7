"""``mrc-agent record``: write a replay trace from the local GPUs.

The output is the replay format (``docs/replay-format.md``), built from the same field table the
replay backend reads, so a recording replays without conversion. Device, GPM and profiling
samples are merged per device per tick, keyed by UUID: a GPU in MIG mode gets its own row and
one per MIG device, all under the physical GPU's ``gpu`` index (keyed by index, a MIG device's
row would overwrite its GPU's). A source that is unavailable is skipped with one line on
stderr and its fields are simply absent. The first line names the format's version; where
CUPTI PM sampling gives a GPU-activity timeline, each row carries the points decoded since the
row before (``activity``, times from the trace start) and the metric they were read from.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from mrc_agent.agent.core.hw.base import HardwareError, SourceUnavailable, finite, ratio
from mrc_agent.agent.core.hw.replay import FORMAT_VERSION, TRACE_FIELDS
from mrc_agent.agent.core.hw.sources import Sources

#: (sample kind, attribute) -> trace field, the inverse of the replay table.
_FIELD_OF = {(kind, attr): key for key, (kind, attr, _) in TRACE_FIELDS.items()}

EXIT_NO_GPU = 1


class _Activity:
    """Each device's activity points as trace rows: seconds from the trace start, rounded as
    ``t`` is, each later than the device's last one written (the reader refuses a repeat)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.last: dict[str, float] = {}

    def add(self, row: dict[str, Any], s: Any) -> None:
        metric = getattr(s, "activity_metric", None)
        if metric is None:
            return
        row["activity_metric"] = metric
        points, last = [], self.last.get(s.gpu.uuid, -1.0)
        for when, value in s.activity_points:
            t, share = round(when - self.start, 4), ratio(value)
            if t >= 0 and t > last and share is not None:
                points.append([t, round(share, 4)])
                last = t
        if points:
            row["activity"] = points
            self.last[s.gpu.uuid] = last


def _merge(rows: dict[str, dict[str, Any]], kind: str, samples: list[Any],
           activity: _Activity) -> None:
    for s in samples:
        row = rows.setdefault(s.gpu.uuid, {"gpu": s.gpu.index, "uuid": s.gpu.uuid,
                                            "name": s.gpu.name})
        if isinstance(getattr(s, "gpu_instance", None), int):
            row["gpu_instance"] = s.gpu_instance  # GPM of a MIG device: its GPU instance's
        if kind == "profiling":
            activity.add(row, s)
        for (k, attr), key in _FIELD_OF.items():
            if k == kind:
                # The replay validator refuses NaN, infinities and ratios over 1, so a trace
                # holds none: what the adapters let through is cleaned here once more.
                clean = ratio if TRACE_FIELDS[key][2] == "ratio" else finite
                value = clean(getattr(s, attr, None))
                if value is not None and value >= 0:
                    row[key] = value


def record(sources: Sources, out: TextIO, duration: float, interval: float,
           clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep, err: TextIO = sys.stderr) -> int:
    """Sample every ``interval`` for ``duration`` seconds; returns the number of sample lines
    (the version line before them is not one)."""
    said: set[str] = set()
    kinds = [("device", sources.device, "sample_devices"), ("gpm", sources.gpm, "sample_gpm"),
             ("profiling", sources.profiling, "sample_profiling")]
    out.write(json.dumps({"version": FORMAT_VERSION}) + "\n")
    start = clock()
    activity = _Activity(start)
    lines = 0
    tick = 0
    while True:
        now = clock()
        if now - start > duration:
            break
        rows: dict[str, dict[str, Any]] = {}
        for kind, source, method in kinds:
            if source is None:
                continue
            try:
                _merge(rows, kind, getattr(source, method)(), activity)
            except (SourceUnavailable, HardwareError) as exc:
                if kind == "device" and isinstance(exc, SourceUnavailable):
                    raise
                if f"{kind}{exc}" not in said:
                    print(f"mrc-agent record: {kind} not recorded: {exc}", file=err)
                    said.add(f"{kind}{exc}")
        t = round(now - start, 4)
        # By GPU index; within one, the order the sources gave (a GPU before its MIG devices).
        for row in sorted(rows.values(), key=lambda r: int(r["gpu"])):
            out.write(json.dumps({"t": t, **row}) + "\n")
            lines += 1
        tick += 1
        sleep(max(start + tick * interval - clock(), 0.0))
    return lines


def run_record(path: str, duration: float, interval: float, profiling: bool) -> int:
    from mrc_agent.agent.core.config import AgentConfig
    from mrc_agent.agent.core.wiring import PROFILING_INTERVAL_S, make_sources

    # The agent's PM-sampling interval (or the recording's, when finer), so the recorded
    # activity timeline resolves the idle windows the agent's own would.
    sources = make_sources(AgentConfig(gpu_backend="nvml"), profiling=profiling,
                           profiling_interval_s=min(interval, PROFILING_INTERVAL_S))
    try:
        with open(path, "w", encoding="utf-8") as out:
            lines = record(sources, out, duration, interval)
    except SourceUnavailable as exc:
        print(f"mrc-agent record: error: no GPU to record from ({exc})", file=sys.stderr)
        return EXIT_NO_GPU
    except OSError as exc:
        print(f"mrc-agent record: error: cannot write {path}: {exc.strerror}", file=sys.stderr)
        return EXIT_NO_GPU
    finally:
        sources.close()
    print(f"mrc-agent record: wrote {lines} samples to {path}", file=sys.stderr)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mrc_agent.agent.tools.flags import RECORD, RECORD_FLAGS

    RECORD_FLAGS.add_flags(parser, RECORD)


def run(args: argparse.Namespace) -> int:
    from mrc_agent.agent.core.config import ConfigError

    if args.duration <= 0 or not 0.01 <= args.interval <= 60:
        raise ConfigError("--duration must be > 0 and --interval 0.01-60 seconds")
    return run_record(args.out, args.duration, args.interval, args.profiling)
