"""The stacks join pinned at its edges: austin's lines (malformed ones, paths, caches), function
names, why a target cannot be sampled, the sampler's own bookkeeping, and the collector's join
of samples with the GPU timeline: several GPUs (busy while any is, starved only while all are
idle), the first reading's one-second reach, the kept window of GPU points and starvation
verdicts, samples waiting for the timeline, the hottest thread and its decay, the top-k
labels, and the availability reasons with their retries and log lines."""

from __future__ import annotations

import io
from collections.abc import Mapping

import pytest

from mrc_agent.agent.core import stacks as stacks_mod
from mrc_agent.agent.core.collectors.base import PassView, TargetState
from mrc_agent.agent.core.collectors.derived import Starvation
from mrc_agent.agent.core.collectors.stacks import (
    AVAILABLE,
    FUNCTION_SECONDS,
    StacksCollector,
)
from mrc_agent.agent.core.hw.base import GPUIdentity
from mrc_agent.agent.core.stacks import (
    _NAME_CACHE,
    SampleParser,
    StackSample,
    StackSampler,
    StacksUnavailable,
    explain,
    function_name,
    module_of,
)
from tests.support import GPU0, GPU1, pass_view
from tests.support import FakeSampler as Fake

LOGGER = "mrc_agent.agent.core.collectors.stacks"


def _view(now: float, points: Mapping[GPUIdentity, list[tuple[float, float]]] | None = None,
          starved: bool | None = None, gpus: set[GPUIdentity] | None = None, *,
          read: bool = True, processes: bool = True) -> PassView:
    """The pass at ``now`` for target 7: GPU ``points`` (None: no GPU readings at all), the
    target's GPUs, the starvation verdict (None: no Starvation output)."""
    return pass_view(
        now, (7,),
        processes=({7: TargetState(7, "python")} if read else {}) if processes else None,
        points=points, util={g: p[-1][1] for g, p in points.items() if p} if points else None,
        gpus_of_pid={7: gpus} if gpus else None,
        outputs=[] if starved is None else [Starvation({7: starved})])


def _seconds(out: list) -> dict[tuple[str, str], float]:
    return {(labels[2], labels[3]): round(v, 9) for name, labels, v in out
            if name == FUNCTION_SECONDS.name}


def _collector(sampler: Fake, clock: float = 0.0) -> StacksCollector:
    return StacksCollector(lambda pid: sampler, idle_util=0.05, clock=lambda: clock)


def _s(t: float, seconds: float = 0.1, thread: str = "T0:1", function: str = "app:f"
       ) -> StackSample:
    return StackSample(t, seconds, thread, function)


# -- the GPU state of a sample --------------------------------------------------------------

@pytest.mark.parametrize(("u0", "u1", "starved", "state"), [
    (0.9, 0.0, True, "busy"),
    (0.0, 0.9, True, "busy"),
    (0.0, 0.0, True, "starved"),
    (0.05, 0.05, True, "starved"),  # at the idle threshold is idle
    (0.0501, 0.0, True, "busy"),  # just past it
    (0.0, 0.0, False, "idle"),
    (0.05, 0.0, False, "idle"),
], ids=["gpu0-busy", "gpu1-busy", "both-idle-starved", "at-threshold-idle",
        "past-threshold-busy", "both-idle-not-starved", "at-threshold-not-starved"])
def test_a_moment_is_busy_while_any_gpu_is_and_starved_only_while_all_idle(
        u0: float, u1: float, starved: bool, state: str) -> None:
    c = _collector(Fake([_s(1.0)]))
    out = c.update(_view(1.0, {GPU0: [(1.0, u0)], GPU1: [(1.0, u1)]}, starved,
                         {GPU0, GPU1})).samples
    assert _seconds(out) == {("app:f", state): 0.1}


@pytest.mark.parametrize("gpu0_points", [[], [(6.0, 0.0)]],
                         ids=["no-reading-at-all", "timeline-starting-later"])
def test_a_gpu_with_no_reading_covering_the_sample_is_left_out_of_its_state(
        gpu0_points: list[tuple[float, float]]) -> None:
    points = {GPU1: [(1.0, 0.9), (6.0, 0.9)]}
    if gpu0_points:
        points[GPU0] = gpu0_points
    c = _collector(Fake([_s(1.0)]))
    out = c.update(_view(6.0, points, True, {GPU0, GPU1})).samples
    assert _seconds(out) == {("app:f", "busy"): 0.1}


@pytest.mark.parametrize(("t", "state"), [(2.0, "busy"), (1.0, "busy"), (0.75, "unknown")],
                         ids=["at-the-first-reading", "one-second-before", "past-one-second"])
def test_the_first_reading_covers_the_second_before_it_and_no_more(t: float, state: str
                                                                     ) -> None:
    c = _collector(Fake([_s(t)]))
    out = c.update(_view(3.0, {GPU0: [(2.0, 0.9), (3.0, 0.9)]}, None, {GPU0})).samples
    assert _seconds(out) == {("app:f", state): 0.1}


def test_the_gpu_timeline_is_kept_keep_s_back_the_limit_included() -> None:
    sampler = Fake()
    c = _collector(sampler)
    c.update(_view(10.0, {GPU0: [(9.0, 0.9), (10.0, 0.9)]}))
    # Late samples: at 130 the point at 10.0 is exactly KEEP_S old and kept, 9.0 is gone.
    sampler.samples = [_s(8.5, 0.2, function="app:old"), _s(10.0, 0.4, function="app:edge")]
    out = c.update(_view(130.0, {GPU0: [(130.0, 0.9)]})).samples
    assert _seconds(out) == {("app:old", "unknown"): 0.2, ("app:edge", "busy"): 0.4}


def test_points_sent_again_are_kept_once_and_never_rewrite_the_timeline() -> None:
    sampler = Fake()
    c = _collector(sampler)
    c.update(_view(2.0, {GPU0: [(1.0, 0.9), (2.0, 0.9)]}))
    sampler.samples = [_s(1.5)]
    out = c.update(_view(3.0, {GPU0: [(1.0, 0.0), (2.0, 0.0), (3.0, 0.0)]})).samples
    assert _seconds(out) == {("app:f", "busy"): 0.1}
    assert c._points[GPU0] == [(1.0, 0.9), (2.0, 0.9), (3.0, 0.0)]


def test_a_samples_starvation_is_the_first_verdict_at_or_after_it() -> None:
    sampler = Fake()
    c = _collector(sampler)
    c.update(_view(1.0, {GPU0: [(1.0, 0.0)]}, False))
    sampler.samples = [_s(1.0, 0.1, function="app:at"), _s(1.5, 0.2, function="app:after")]
    out = c.update(_view(2.0, {GPU0: [(2.0, 0.0)]}, True)).samples
    assert _seconds(out) == {("app:at", "idle"): 0.1, ("app:after", "starved"): 0.2}


@pytest.mark.parametrize("starved", [True, None], ids=["after-the-last-verdict", "no-verdict"])
def test_an_idle_sample_with_no_verdict_after_it_is_idle(starved: bool | None) -> None:
    c = _collector(Fake([_s(1.5)]))
    out = c.update(_view(1.0, {GPU0: [(1.0, 0.0), (2.0, 0.0)]}, starved)).samples
    assert _seconds(out) == {("app:f", "idle"): 0.1}


def test_starvation_verdicts_are_kept_keep_s_back_the_limit_included() -> None:
    sampler = Fake()
    c = _collector(sampler)
    c.update(_view(10.0, {GPU0: [(10.0, 0.0)]}, False))
    sampler.samples = [_s(10.0)]
    out = c.update(_view(130.0, {GPU0: [(130.0, 0.0)]}, True)).samples
    assert _seconds(out) == {("app:f", "idle"): 0.1}


def test_without_any_gpu_timeline_samples_older_than_keep_s_are_unknown_and_newer_wait(
        ) -> None:
    sampler = Fake([_s(70.0, 0.1), _s(80.0, 0.2), _s(90.0, 0.4)])
    clock = [200.0]
    c = StacksCollector(lambda pid: sampler, idle_util=0.05, clock=lambda: clock[0])
    assert _seconds(c.update(_view(200.0)).samples) == {("app:f", "unknown"): 0.3}
    clock[0] = 210.0
    assert _seconds(c.update(_view(210.0)).samples) == {("app:f", "unknown"): 0.7}


def test_samples_wait_until_the_slowest_gpu_of_the_target_covers_them() -> None:
    c = _collector(Fake([_s(1.0), _s(2.0, 0.2), _s(3.0, 0.4)]))
    out = c.update(_view(3.0, {GPU0: [(1.0, 0.9), (3.0, 0.9)], GPU1: [(2.0, 0.0)]}, None,
                         {GPU0, GPU1})).samples
    assert _seconds(out) == {("app:f", "busy"): 0.3}


# -- the hottest thread ---------------------------------------------------------------------

@pytest.mark.parametrize(("later", "got"), [
    ([(10.5, 0.45), (11.0, 0.45)], {("app:one", "busy"): 2.0}),
    ([(10.5, 0.55), (11.0, 0.55)], {("app:one", "busy"): 2.0, ("app:two", "busy"): 1.1}),
    ([(1.25, 0.95), (1.5, 0.95)], {("app:one", "busy"): 2.0}),
], ids=["ten-s-later-half-its-heat-beats-0.9", "ten-s-later-loses-to-1.1",
        "half-a-second-later-keeps-97pc-and-beats-1.9"])
def test_the_hottest_threads_heat_halves_every_ten_seconds(
        later: list[tuple[float, float]], got: dict[tuple[str, str], float]) -> None:
    sampler = Fake([_s(t, 0.5, "T0:1", "app:one") for t in (0.25, 0.5, 0.75, 1.0)])
    c = _collector(sampler)
    c.update(_view(1.0, {GPU0: [(1.0, 0.9)]}))
    sampler.samples = [_s(t, s, "T0:2", "app:two") for t, s in later]
    assert _seconds(c.update(_view(11.0, {GPU0: [(11.0, 0.9)]})).samples) == got


def test_a_thread_whose_heat_decayed_to_a_thousandth_is_forgotten() -> None:
    sampler = Fake([_s(1.0, 0.002, "T0:1", "app:one")])
    c = _collector(sampler)
    c.update(_view(1.0, {GPU0: [(1.0, 0.9)]}))
    sampler.samples = [_s(11.0, 0.0009, "T0:2", "app:two")]  # T0:1 now exactly 0.001
    assert _seconds(c.update(_view(11.0, {GPU0: [(11.0, 0.9)]})).samples) == {
        ("app:one", "busy"): 0.002, ("app:two", "busy"): 0.0009}


def test_the_hottest_threads_samples_count_wherever_the_others_are_among_them() -> None:
    c = _collector(Fake([_s(0.1, 0.1, "T0:2", "app:two"), _s(0.2, 0.5, "T0:1", "app:one"),
                         _s(0.3, 0.5, "T0:1", "app:one")]))
    out = c.update(_view(1.0, {GPU0: [(1.0, 0.9)]})).samples
    assert _seconds(out) == {("app:one", "busy"): 1.0}


def test_the_default_top_k_is_five_functions_then_other() -> None:
    c = _collector(Fake([_s(k / 10, 0.1, function=f"app:f{k}") for k in range(1, 8)]))
    got = _seconds(c.update(_view(1.0, {GPU0: [(1.0, 0.9)]})).samples)
    assert got == {**{(f"app:f{k}", "busy"): 0.1 for k in range(1, 6)},
                   ("other", "busy"): 0.2}


# -- availability ---------------------------------------------------------------------------

def test_a_pass_without_the_process_collector_drops_every_target() -> None:
    sampler = Fake([_s(0.5)])
    c = _collector(sampler)
    c.update(_view(1.0, {GPU0: [(1.0, 0.9)]}))
    assert c.update(_view(2.0, {GPU0: [(2.0, 0.9)]}, processes=False)).samples == []
    assert sampler.stopped == 1


def test_a_target_that_comes_back_is_told_about_again(caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    c = StacksCollector(lambda pid: Fake([], StacksUnavailable("permission", "no ptrace"),
                                         alive=False), idle_util=0.05, clock=lambda: 0.0)
    with caplog.at_level("WARNING", logger=LOGGER):
        for now, read in ((1.0, True), (2.0, True), (3.0, False), (4.0, True), (5.0, True)):
            c.update(_view(now, {GPU0: [(now, 0.9)]}, read=read))
    assert [r.getMessage() for r in caplog.records] == ["no stacks for pid 7: no ptrace"] * 2


@pytest.mark.parametrize(("unavailable", "said"), [
    (None, "austin is not installed"),
    (StacksUnavailable("missing", "austin not found in /opt/x"), "austin not found in /opt/x"),
], ids=["default", "the-finders-reason"])
def test_without_austin_the_agent_says_once_why_and_every_target_is_missing(
        caplog: pytest.LogCaptureFixture, unavailable: StacksUnavailable | None, said: str
        ) -> None:
    c = StacksCollector(None, idle_util=0.05, unavailable=unavailable)
    with caplog.at_level("WARNING", logger=LOGGER):
        out = c.update(_view(1.0, {GPU0: [(1.0, 0.9)]})).samples
    assert out == [(AVAILABLE.name, ("7", "python", "missing"), 0.0)]
    assert [r.getMessage() for r in caplog.records] == [
        f"no stacks for any target: {said}; the other collectors run on"]


@pytest.mark.parametrize(("error", "reason", "retried"), [
    (None, "failed", True),
    (StacksUnavailable("failed", "crashed"), "failed", True),
    (StacksUnavailable("gone", "pid is gone"), "gone", True),
    (StacksUnavailable("permission", "no ptrace"), "permission", False),
    (StacksUnavailable("not_python", "not python"), "not_python", False),
], ids=["stopped-without-a-word", "failed", "gone", "permission", "not-python"])
def test_a_sampler_that_stopped_says_why_and_is_retried_after_retry_s_unless_for_rights(
        caplog: pytest.LogCaptureFixture, error: StacksUnavailable | None, reason: str,
        retried: bool) -> None:
    made: list[Fake] = []
    pids: list[int] = []

    def factory(pid: int) -> Fake:
        pids.append(pid)
        made.append(Fake([], error, alive=bool(made)))
        return made[-1]

    now = [0.0]
    c = StacksCollector(factory, idle_util=0.05, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger=LOGGER):
        c.update(_view(1.0, {GPU0: [(1.0, 0.9)]}))
        out = c.update(_view(2.0, {GPU0: [(2.0, 0.9)]})).samples
    assert (AVAILABLE.name, ("7", "python", reason), 0.0) in out
    message = "austin stopped" if error is None else str(error)
    assert [r.getMessage() for r in caplog.records] == [f"no stacks for pid 7: {message}"]
    now[0] = 29.9
    c.update(_view(3.0, {GPU0: [(3.0, 0.9)]}))
    assert len(made) == 1
    now[0] = 30.0
    out = c.update(_view(4.0, {GPU0: [(4.0, 0.9)]})).samples
    assert len(made) == (2 if retried else 1) and pids == [7] * len(made)
    assert (AVAILABLE.name, ("7", "python", "ok" if retried else reason),
            1.0 if retried else 0.0) in out


def test_austin_that_does_not_start_is_failed_said_and_retried_after_retry_s(
        caplog: pytest.LogCaptureFixture) -> None:
    made: list[Fake] = []
    pids: list[int] = []

    def factory(pid: int) -> Fake:
        pids.append(pid)
        made.append(Fake(fail=None if made else OSError("exec format error")))
        return made[-1]

    now = [0.0]
    c = StacksCollector(factory, idle_util=0.05, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger=LOGGER):
        out = c.update(_view(1.0, {GPU0: [(1.0, 0.9)]})).samples
    assert out == [(AVAILABLE.name, ("7", "python", "failed"), 0.0)]
    assert [r.getMessage() for r in caplog.records] == [
        "no stacks for pid 7: austin did not start: exec format error"]
    now[0] = 29.9
    c.update(_view(2.0, {GPU0: [(2.0, 0.9)]}))
    assert len(made) == 1
    now[0] = 30.0
    out = c.update(_view(3.0, {GPU0: [(3.0, 0.9)]})).samples
    assert out == [(AVAILABLE.name, ("7", "python", "ok"), 1.0)]
    assert pids == [7, 7]


# -- austin's lines -------------------------------------------------------------------------

@pytest.mark.parametrize(("line", "want"), [
    ("P7;T0:7;/srv/my app/m.py:f:1 100000\n", ("T0:7", "m:f", 0.1, ("/srv/my app/m.py:f:1",))),
    ("P7;T0:7;/srv/m.py:f:1 250000,0,2048\n", ("T0:7", "m:f", 0.25, ("/srv/m.py:f:1",))),
    ("P7;T0:7;/srv/m.py:f:1 0\n", ("T0:7", "m:f", 0.0, ("/srv/m.py:f:1",))),
    ("P7;T0:7;/srv/m.py:f:1 -5\n", ("T0:7", "m:f", 0.0, ("/srv/m.py:f:1",))),
    ("P7;T0:7;/srv/m.py:f:1 1000000\n", ("T0:7", "m:f", 1.0, ("/srv/m.py:f:1",))),
    ("P7;T0:7;/srv/m.py:f:1 3000000\n", ("T0:7", "m:f", 2.0, ("/srv/m.py:f:1",))),
    ("P7;;/srv/m.py:f:1 100000\n", ("", "m:f", 0.1, ("/srv/m.py:f:1",))),
    ("P7;T0:9;/srv/a.py:g:1;<frozen runpy>:_run_code:88;:INVALID: 100000\n",
     ("T0:9", "<frozen runpy>:_run_code", 0.1, ("/srv/a.py:g:1", "<frozen runpy>:_run_code:88"))),
    ("P7;T0:9;/srv/a.py:g:1;:INVALID:;:INVALID: 100000\n",
     ("T0:9", "a:g", 0.1, ("/srv/a.py:g:1",))),
    ("P7;T0:9;/srv/a.py:g:1;:INVALID:;;/srv/b.py:h:2 100000\n",
     ("T0:9", "b:h", 0.1, ("/srv/a.py:g:1", "/srv/b.py:h:2"))),
    ("P7;T0:7;/srv/m.py:f:1 100000 \n", None),
    ("P7;T0:7;/srv/m.py:f:1 100000X\n", None),
    ("P7;T0:7;/srv/m.py:f:1\n", None),
    ("P7;T0:9;:INVALID:;:INVALID: 100000\n", None),
], ids=["space-in-path", "full-metrics", "zero", "negative", "one-second", "capped",
        "empty-thread", "invalid-leaf-its-caller", "two-invalid-frames",
        "invalid-and-empty-frames-left-out", "trailing-blank", "junk-metric", "no-metric",
        "only-invalid"])
def test_austin_lines_parse_to_exactly_this(
        line: str, want: tuple[str, str, float, tuple[str, ...]] | None) -> None:
    s = SampleParser(max_seconds=2.0).line(line, 5.0)
    got = None if s is None else (s.thread, s.function, s.seconds, s.frames)
    assert got == want
    assert s is None or s.t == 5.0


def test_every_malformed_line_is_counted_and_metadata_is_not() -> None:
    parser = SampleParser()
    for line in ("P7 garbage\n", "P7;T0:9;:INVALID: 1\n", "# mode: wall\n", "\n",
                 "P7;T0:7;/a.py:f:1 x\n", "P7;T0:7;/a.py:f:1 5\n"):
        parser.line(line, 1.0)
    assert parser.bad_lines == 3


def test_a_sample_stands_for_a_second_at_most_by_default() -> None:
    s = SampleParser().line("P7;T0:7;/a.py:f:1 5000000\n", 0.0)
    assert s is not None and s.seconds == 1.0


def test_the_name_and_stack_caches_are_bounded() -> None:
    parser = SampleParser()
    for k in range(_NAME_CACHE + 1):
        s = parser.line(f"P7;T0:7;/srv/m.py:f{k}:1 100\n", 0.0)
        assert s is not None and s.function == f"m:f{k}"
    assert len(parser._names) <= _NAME_CACHE and len(parser._stacks) <= _NAME_CACHE


@pytest.mark.parametrize(("path", "module"), [
    ("<doctest pkg/mod.py[0]>", "<doctest pkg/mod.py[0]>"),
    ("/srv/app/__init__.py", "__init__"),
    ("/srv/app/", "?"),
    ("", "?"),
], ids=["pseudo-file-as-is", "lone-init", "no-file-name", "empty"])
def test_odd_files_module_names(path: str, module: str) -> None:
    assert module_of(path) == module


@pytest.mark.parametrize(("frame", "name"), [
    ("/srv/app/m.py:f", "m:f"),
    ("/srv/a:b/m.py:f:1", "m:f"),
    ("x" * 200, "x" * 128),
    (f"/srv/m.py:{'g' * 200}:1", f"m:{'g' * 126}"),
], ids=["no-line-number", "colon-in-path", "no-qualname-cut", "long-name-cut"])
def test_odd_frames_names(frame: str, name: str) -> None:
    assert function_name(frame) == name


# -- why austin could not sample ------------------------------------------------------------

PERMISSION = ("austin cannot read pid 42: permission denied. Run as root or as the target's "
              "user with kernel.yama.ptrace_scope=0; in Kubernetes the pod needs "
              "CAP_SYS_PTRACE and shareProcessNamespace: true")


@pytest.mark.parametrize(("stderr", "reason", "message"), [
    ("", "failed", "austin failed on pid 42: no output"),
    ("\n\U0001f47e XPC error\nmore", "failed", "austin failed on pid 42: XPC error"),
    ("Operation not permitted", "permission", PERMISSION),
    ("Cannot find the Python interpreter", "not_python",
     "pid 42 is not a Python process austin can read (austin: Cannot find the Python "
     "interpreter)"),
    ("unsupported python version 3.99", "failed",
     "austin failed on pid 42: unsupported python version 3.99"),
    ("\U0001f6d1 No such process", "gone", "pid 42 is gone (austin: No such process)"),
], ids=["no-output", "first-line-less-its-emoji", "not-permitted", "cannot-read-python",
        "python-without-cannot", "no-such-process"])
def test_austins_failures_say_why_in_these_words(stderr: str, reason: str, message: str
                                                 ) -> None:
    err = explain(stderr, 42)
    assert (err.reason, str(err)) == (reason, message)


def test_a_target_the_agent_may_not_read_is_a_matter_of_rights_whatever_austin_says() -> None:
    assert explain("No such process", 42, False).reason == "permission"


# -- the sampler's bookkeeping --------------------------------------------------------------

class _Proc:
    def __init__(self, rc: int) -> None:
        self.rc, self.waited = rc, 0

    def wait(self) -> int:
        self.waited += 1
        return self.rc


def _fed(lines: str, interval: float = 0.1) -> StackSampler:
    ticks = iter(range(1000))
    sampler = StackSampler("austin", 7, interval, clock=lambda: float(next(ticks)))
    sampler._read(_Proc(0), io.StringIO(lines))  # type: ignore[arg-type]
    return sampler


def test_a_sampler_not_started_is_not_running_has_no_error_and_stops() -> None:
    sampler = StackSampler("austin", 7, 0.1)
    assert not sampler.running() and sampler.error is None
    sampler.stop()
    assert sampler.take() == [] and sampler.history(0.0) == []


def test_the_samples_waiting_to_be_taken_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stacks_mod, "MAX_PENDING", 8)
    sampler = _fed("".join(f"P7;T0:7;/srv/m.py:f{k}:1 100\n" for k in range(50)))
    taken = sampler.take()
    assert [s.function for s in taken] == [f"m:f{k}" for k in range(42, 50)]


def test_a_samples_seconds_are_capped_at_three_intervals() -> None:
    (s,) = _fed("P7;T0:7;/srv/m.py:f:1 5000000\n", interval=0.1).take()
    assert s.seconds == pytest.approx(0.3)


def test_the_history_starts_at_since_itself() -> None:
    sampler = _fed("".join(f"P7;T0:7;/srv/m.py:f{k}:1 100\n" for k in range(4)))
    assert [s.t for s in sampler.history(2.0)] == [2.0, 3.0]


@pytest.mark.parametrize(("rc", "stopping", "readable", "reason"), [
    (0, False, True, None),
    (1, False, True, "gone"),
    (1, True, True, None),
    (1, False, False, "permission"),
], ids=["clean-exit", "failed", "stopped-by-the-agent", "unreadable-target"])
def test_austins_exit_sets_the_error_only_when_it_failed_on_its_own(
        monkeypatch: pytest.MonkeyPatch, rc: int, stopping: bool, readable: bool,
        reason: str | None) -> None:
    asked: list[int] = []

    def may_read(pid: int, proc: str = "/proc") -> bool:
        asked.append(pid)
        return readable

    monkeypatch.setattr(stacks_mod, "may_read", may_read)
    sampler = StackSampler("austin", 7, 0.1)
    sampler._err = io.StringIO("\U0001f6d1 No such process\n")
    if stopping:
        sampler.stop()
    proc = _Proc(rc)
    sampler._read(proc, io.StringIO(""))  # type: ignore[arg-type]
    assert proc.waited == 1
    assert (sampler.error.reason if sampler.error is not None else None) == reason
    if reason is not None:
        assert "pid 7" in str(sampler.error) and asked == [7]
