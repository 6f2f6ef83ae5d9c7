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


# --- version 2: the hardware activity timeline ----------------------------------------------

V2 = {"version": 2}
METRIC = "gr__cycles_active.avg.pct_of_peak_sustained_elapsed"


@pytest.mark.parametrize(
    ("rows", "line", "reason"),
    [
        ([{"version": 3}, {"t": 0, "gpu": 0}], 1, "version 3 is newer than this mrc-agent"),
        ([{"version": "2"}, {"t": 0, "gpu": 0}], 1, "'version' must be an integer"),
        ([{"version": True}, {"t": 0, "gpu": 0}], 1, "'version' must be an integer"),
        ([{"version": 0}, {"t": 0, "gpu": 0}], 1, "'version' must be an integer >= 1"),
        ([{"t": 0, "gpu": 0}, V2], 2, "must be the first line"),
        ([V2, V2, {"t": 0, "gpu": 0}], 2, "must be the first line"),
        ([{"t": 0, "gpu": 0, "activity_metric": METRIC, "activity": [[0, 1]]}], 1,
         "version 2 fields"),
        ([{"version": 1}, {"t": 0, "gpu": 0, "activity_metric": METRIC}], 2, "version 2 fields"),
        ([V2, {"t": 0, "gpu": 0, "activity": [[0, 1]]}], 2, "needs 'activity_metric'"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": 7}], 2, "must be a metric name"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": ""}], 2, "must be a metric name"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": "x" * 257}], 2, "must be a metric name"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": "a"},
          {"t": 1, "gpu": 0, "activity_metric": "b"}], 3, "changed activity_metric to 'b'"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": METRIC, "activity": {"0": 1}}], 2,
         "must be a list"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": METRIC, "activity": [[0, 0]] * 10_001}], 2,
         "at most 10000"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": METRIC, "activity": [[0, 1.5]]}], 2,
         "ratio 0-1"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": METRIC, "activity": [[-1, 0.5]]}], 2,
         "t >= 0"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": METRIC, "activity": [[0, 0.5, 1]]}], 2,
         "[t >= 0, ratio"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": METRIC, "activity": [["0", 0.5]]}], 2,
         "[t >= 0, ratio"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": METRIC, "activity": [[0, True]]}], 2,
         "[t >= 0, ratio"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": METRIC, "activity": [[0.1, 1], [0.1, 0]]}],
         2, "times must increase"),
        ([V2, {"t": 0, "gpu": 0, "activity_metric": METRIC, "activity": [[0.2, 1]]},
          {"t": 1, "gpu": 0, "activity": [[0.1, 0]]}], 3, "(0.2 then 0.1)"),
    ],
)
def test_malformed_version_2_fields_name_line_and_reason(tmp_path, rows, line, reason) -> None:
    path = _write(tmp_path, rows)
    with pytest.raises(ReplayFormatError) as err:
        load_trace(path)
    assert f"{path}:{line}:" in str(err.value)
    assert reason in str(err.value)


def test_a_version_line_alone_holds_no_samples_and_version_1_still_reads(tmp_path) -> None:
    with pytest.raises(ReplayFormatError, match="no samples"):
        load_trace(_write(tmp_path, [V2]))
    (trace,) = load_trace(_write(tmp_path, [{"version": 1}, {"t": 0, "gpu": 0}])).values()
    assert trace.times == [0.0] and trace.activity_metric is None


def test_activity_points_play_once_each_on_the_agent_clock_across_loops(tmp_path) -> None:
    # Two devices; GPU 1's timeline rides in rows without counters (activity alone).
    rows: list[object] = [V2]
    for t in (0.0, 0.1, 0.2):
        pts = [[round(t + d, 3), 1.0 if d < 0.05 else 0.0] for d in (0.02, 0.04, 0.06, 0.08)]
        rows.append({"t": t, "gpu": 0, "sm_instructions_executed_total": 10 * t,
                     "activity_metric": METRIC, "activity": pts})
        rows.append({"t": t, "gpu": 1, "activity_metric": METRIC, "activity": pts[:1]})
    clock = Clock()
    backend = ReplayBackend(_write(tmp_path, rows), clock=clock)
    assert backend.period == pytest.approx(0.3)
    clock.t = 1000.05
    first = {s.gpu.index: s for s in backend.sample_profiling()}
    assert first[0].activity_metric == METRIC == first[1].activity_metric
    assert first[1].sm_instructions_executed_total is None
    # Only the points the trace has passed, dated start + t: 0.02 and 0.04.
    assert [p for p in first[0].activity_points] == [
        (pytest.approx(1000.02), 1.0), (pytest.approx(1000.04), 1.0)]
    clock.t = 1000.0 + 0.3 + 0.03  # into the second loop
    (again, other) = backend.sample_profiling()
    times = [t - 1000.0 for t, _ in again.activity_points]
    assert times == pytest.approx([0.06, 0.08, 0.12, 0.14, 0.16, 0.18, 0.22, 0.24, 0.26, 0.28,
                                   0.32])  # the next loop's 0.02, dated one period later
    assert [v for _, v in again.activity_points][:2] == [0.0, 0.0]
    assert [t - 1000.0 for t, _ in other.activity_points] == pytest.approx([0.12, 0.22, 0.32])
    assert backend.sample_profiling()[0].activity_points == ()  # nothing new since


def test_a_long_pause_hands_out_at_most_the_cap_of_activity_points(tmp_path) -> None:
    pts = [[round(k * 0.001, 3), 0.5] for k in range(1, 1001)]
    rows = [V2, {"t": 0, "gpu": 0, "activity_metric": METRIC, "activity": pts},
            {"t": 1.0, "gpu": 0}]
    clock = Clock()
    backend = ReplayBackend(_write(tmp_path, rows), clock=clock)
    clock.t += 1000 * backend.period  # a thousand loops of a thousand points
    (s,) = backend.sample_profiling()
    assert len(s.activity_points) == 10_000
    stamps = [t for t, _ in s.activity_points]
    assert stamps == sorted(stamps) and stamps[-1] <= clock.t


def test_start_sets_the_moment_the_trace_begins_on_the_clock(tmp_path) -> None:
    rows = [{"t": t, "gpu": 0, "gpu_util": u} for t, u in [(0, 0.1), (1, 0.2), (2, 0.3)]]
    clock = Clock()
    backend = ReplayBackend(_write(tmp_path, rows), clock=clock, start=clock.t + 5.0)
    assert backend.sample_devices()[0].gpu_util == 0.1  # before its start: the first row
    clock.t += 6.5
    assert backend.sample_devices()[0].gpu_util == 0.2  # 1.5 s in, not 6.5
