"""Replay backend: validation with line numbers, wall-clock pacing, looping counters."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from mrc_agent.agent.core.hw.base import SourceUnavailable
from mrc_agent.agent.core.hw.replay import ReplayBackend, ReplayFormatError, load_trace
from tests.support import Clock


def _write(tmp_path, rows: Sequence[object]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    ("rows", "line", "reason"),
    [
        ([{"t": 0, "gpu": 0}, "{not json"], 2, "not valid JSON"),
        ([{"gpu": 0}], 1, "'t' must be a number"),
        ([{"t": 0, "gpu": -1}], 1, "'gpu' must be an integer"),
        ([{"t": 0, "gpu": 0, "gpu_util": 1.5}], 1, "0-1 ratio"),
        ([{"t": 0, "gpu": 0, "power_watts": "hot"}], 1, "must be a number"),
        ([{"t": 0, "gpu": 0, "nvlink_tx_bytes_total": 10},
          {"t": 1, "gpu": 0, "nvlink_tx_bytes_total": 5}], 2, "decreases"),
        ([{"t": 1, "gpu": 0}, {"t": 0.5, "gpu": 0}], 2, "goes backwards"),
        ([[1, 2]], 1, "expected a JSON object"),
        ([{"t": 0, "gpu": 0, "uuid": "A"}, {"t": 1, "gpu": 0, "uuid": "B"}], 2, "changed uuid"),
    ],
)
def test_malformed_trace_names_line_and_reason(tmp_path, rows, line, reason) -> None:
    path = _write(tmp_path, rows)
    with pytest.raises(ReplayFormatError) as err:
        load_trace(path)
    assert f"{path}:{line}:" in str(err.value)
    assert reason in str(err.value)


def test_empty_and_missing_files_are_refused(tmp_path) -> None:
    with pytest.raises(ReplayFormatError, match="no samples"):
        load_trace(_write(tmp_path, []))
    with pytest.raises(ReplayFormatError, match="cannot read"):
        load_trace(str(tmp_path / "nope.jsonl"))


def test_plays_at_wall_clock_pace_and_loops_with_monotonic_counters(tmp_path) -> None:
    rows = [{"t": t, "gpu": 0, "uuid": "GPU-x", "name": "NVIDIA H200", "gpu_util": u,
             "nvlink_tx_bytes_total": 100 * t, "sm_util": 0.5, "extra_field": "kept"}
            for t, u in [(0, 0.1), (1, 0.2), (2, 0.3)]]
    clock = Clock()
    backend = ReplayBackend(_write(tmp_path, rows), clock=clock)
    assert backend.period == 3.0
    seen = []
    for dt in [0.0, 0.5, 1.0, 2.9, 3.0, 4.2, 6.0, 9.0]:
        clock.t = 1000.0 + dt
        (s,) = backend.sample_devices()
        seen.append((s.gpu_util, s.nvlink_tx_bytes_total))
    assert [u for u, _ in seen] == [0.1, 0.1, 0.2, 0.3, 0.1, 0.2, 0.1, 0.1]
    counters = [c for _, c in seen]
    assert None not in counters
    assert counters == sorted(c or 0.0 for c in counters)  # monotonic across loops
    # Each loop adds the trace's rise (200) plus one mean step (100).
    assert counters[4] == 300 and counters[6] == 600 and counters[7] == 900
    assert s.gpu.uuid == "GPU-x" and s.gpu.name == "NVIDIA H200"


def test_fine_grained_util_points_cover_every_trace_step(tmp_path) -> None:
    rows = [{"t": i * 0.1, "gpu": 0, "gpu_util": float(i % 2)} for i in range(10)]
    clock = Clock()
    backend = ReplayBackend(_write(tmp_path, rows), clock=clock)
    (first,) = backend.sample_devices()
    assert len(first.util_samples) == 1
    clock.t += 0.55
    (s,) = backend.sample_devices()
    assert [u for _, u in s.util_samples] == [1.0, 0.0, 1.0, 0.0, 1.0]
    times = [t for t, _ in s.util_samples]
    assert times == sorted(times) and times[-1] <= clock.t


def test_absent_sections_are_unavailable_not_zero(tmp_path) -> None:
    backend = ReplayBackend(_write(tmp_path, [{"t": 0, "gpu": 0, "gpu_util": 0.5}]))
    assert backend.sample_devices()[0].gpu_util == 0.5
    with pytest.raises(SourceUnavailable) as err:
        backend.sample_gpm()
    assert err.value.reason == "gpm_unsupported"
    with pytest.raises(SourceUnavailable):
        backend.sample_profiling()


def test_a_gpu_that_appears_later_is_absent_until_then(tmp_path) -> None:
    rows = [{"t": t, "gpu": 0, "gpu_util": 0.5, "nvlink_tx_bytes_total": 10 * t}
            for t in (0, 1, 2, 3)]
    rows += [{"t": t, "gpu": 1, "gpu_util": 0.9, "nvlink_tx_bytes_total": 7 * t} for t in (2.5, 3)]
    clock = Clock()
    backend = ReplayBackend(_write(tmp_path, rows), clock=clock)
    clock.t = 1000.0 + 1.0
    assert [s.gpu.index for s in backend.sample_devices()] == [0]
    clock.t = 1000.0 + 2.6
    assert [s.gpu.index for s in backend.sample_devices()] == [0, 1]
    # In the next loop it stays (its last reading) until the recording reaches it again, and
    # its counter never goes back.
    clock.t = 1000.0 + backend.period + 0.5
    late = {s.gpu.index: s for s in backend.sample_devices()}
    assert set(late) == {0, 1} and (late[1].nvlink_tx_bytes_total or 0) >= 21
