"""The stacks collector: austin's samples parsed, named and joined with the GPU's timeline."""

from __future__ import annotations

import pytest

from mrc_agent.agent.core.collectors.base import PassView, TargetState
from mrc_agent.agent.core.collectors.derived import Starvation
from mrc_agent.agent.core.collectors.stacks import (
    AVAILABLE,
    FUNCTION_SECONDS,
    StacksCollector,
)
from mrc_agent.agent.core.stacks import (
    SampleParser,
    StackSample,
    StacksUnavailable,
    explain,
    function_name,
    module_of,
)
from tests.support import GPU0, GPU1, GPU2, FakeSampler, pass_view

AUSTIN_OUTPUT = """\
# austin: 3.7.0
# interval: 100000
# mode: wall

P7;T0:7;/srv/app/server.py:<module>:3;/srv/app/preprocess.py:resize_image:41 100093
P7;T0:9;/usr/lib/python3.11/threading.py:Thread.run:982 100011
P7;T0:7;/srv/app/server.py:<module>:3;/srv/app/preprocess.py:resize_image:44 99870
P7;T0:7;/srv/app/server.py:<module>:3 2500000
P7;T0:9;/usr/lib/python3.11/threading.py:Thread.run:982;:INVALID: 100000
P7;T0:9;:INVALID: 100000
P7 garbage
P7;T0:7 100000
P7;T0:7;/x.py:f:1 notanumber

# duration: 300000
"""


def test_austin_lines_become_samples_at_their_arrival() -> None:
    parser = SampleParser(max_seconds=0.3)
    arrivals = iter(range(100, 200))
    samples = [s for line in AUSTIN_OUTPUT.splitlines(keepends=True)
               if (s := parser.line(line, float(next(arrivals)))) is not None]
    assert [(s.t, s.thread, s.function, round(s.seconds, 6)) for s in samples] == [
        (104.0, "T0:7", "preprocess:resize_image", 0.100093),
        (105.0, "T0:9", "threading:Thread.run", 0.100011),
        (106.0, "T0:7", "preprocess:resize_image", 0.09987),
        (107.0, "T0:7", "server:<module>", 0.3),  # a first sample's long delta, capped
        (108.0, "T0:9", "threading:Thread.run", 0.1),  # an unreadable frame: its caller
    ]
    assert parser.bad_lines == 4  # and a stack of nothing else is no sample


@pytest.mark.parametrize(("frame", "name"), [
    ("/usr/lib/python3/dist-packages/PIL/Image.py:Image.resize:2193", "PIL.Image:Image.resize"),
    ("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py:Module._call_impl:1511",
     "torch.nn.modules.module:Module._call_impl"),
    ("/venv/lib/python3.11/site-packages/kornia/__init__.py:<module>:1", "kornia:<module>"),
    ("/root/.pyenv/versions/3.11.7/lib/python3.11/json/decoder.py:JSONDecoder.decode:337",
     "json.decoder:JSONDecoder.decode"),
    ("/home/alice/secret-project/preprocess.py:pil_to_tensor:12", "preprocess:pil_to_tensor"),
    ("<frozen runpy>:_run_code:88", "<frozen runpy>:_run_code"),
    ("C:\\odd:f:1", "C:\\odd:f"),
    # Python 3.11's own frames for a comprehension or lambda: the enclosing function's time.
    ("/srv/app/culprit.py:pil_to_tensor.<locals>.<listcomp>:4", "culprit:pil_to_tensor"),
    ("/srv/app/m.py:A.f.<locals>.<genexpr>:9", "m:A.f"),
    ("/srv/app/m.py:A.f.<locals>.<lambda>.<locals>.<listcomp>:9", "m:A.f"),
    ("/srv/app/m.py:A.f.<locals>.inner:9", "m:A.f.<locals>.inner"),
    ("/srv/app/m.py:<listcomp>:9", "m:<listcomp>"),
])
def test_functions_are_named_by_module_and_qualname_never_by_path_or_line(
        frame: str, name: str) -> None:
    assert function_name(frame) == name
    assert "alice" not in function_name(frame) and not name.rsplit(":", 1)[-1].isdigit()


def test_module_of_a_file_outside_any_package_is_its_name() -> None:
    assert module_of("/srv/app/handlers/decode.py") == "decode"
    assert module_of("/usr/lib/python3/dist-packages/numpy/core/__init__.py") == "numpy.core"


@pytest.mark.parametrize(("stderr", "readable", "reason"), [
    ("It looks like you are trying to profile a process that is not a Python\nprocess.",
     True, "not_python"),
    ("It looks like you are trying to profile a process that is not a Python\nprocess.",
     False, "permission"),
    ("Cannot attach to the given process. Make sure that the PID you have provided", True,
     "gone"),
    ("Insufficient permissions", True, "permission"),
    ("", True, "failed"),
])
def test_austins_failures_say_why(stderr: str, readable: bool, reason: str) -> None:
    err = explain(stderr, 42, readable)
    assert err.reason == reason and "42" in str(err)


def _ctx(now: float, points: list[tuple[float, float]], starved: bool | None,
         pid: int = 7, *, read: bool = True) -> PassView:
    """The pass at ``now``: the target ``pid`` (read by the process collector unless
    ``read`` is false), GPU0's ``points`` and, unless None, the target's verdict."""
    verdict = {} if starved is None else {pid: starved}
    return pass_view(now, (pid,),
                     processes={pid: TargetState(pid, "python", 0.5, 0.98)} if read else {},
                     points={GPU0: points}, util={GPU0: points[-1][1]} if points else {},
                     outputs=[Starvation(verdict)])


def _run(c: StacksCollector, view: PassView) -> list:
    return c.update(view).samples


def _seconds(samples: list) -> dict[tuple[str, str], float]:
    return {(labels[2], labels[3]): round(v, 6) for name, labels, v in samples
            if name == FUNCTION_SECONDS.name}


def _run_phases() -> tuple[StacksCollector, list]:
    """Ten seconds at 10 Hz: the GPU busy for 5 s while the main thread runs the model, then
    idle for 5 s while it resizes images (the target starved); a second thread runs a little
    now and then."""
    samples = []
    for i in range(1, 101):
        t = i / 10
        samples.append(StackSample(t, 0.1, "T0:1",
                                   "model:forward" if t <= 5 else "preprocess:resize_image"))
        if i % 10 == 0:
            samples.append(StackSample(t, 0.1, "T0:2", "logging:Handler.emit"))
    sampler = FakeSampler(samples)
    c = StacksCollector(lambda pid: sampler, idle_util=0.05, clock=lambda: 0.0)
    out: list = []
    for second in range(1, 11):
        # NVML's points every 1/6 s, up to this pass.
        pts = [(k / 6, 0.9 if k / 6 <= 5 else 0.0) for k in range((second - 1) * 6 + 1,
                                                                  second * 6 + 1)]
        out = _run(c, _ctx(float(second), pts, starved=second > 5))
    return c, out


def test_the_hottest_threads_seconds_go_to_its_function_and_the_gpus_state() -> None:
    _, out = _run_phases()
    got = _seconds(out)
    assert got[("model:forward", "busy")] == pytest.approx(5.0)
    assert got[("preprocess:resize_image", "starved")] == pytest.approx(5.0)
    assert ("preprocess:resize_image", "busy") not in got  # no second of it while busy
    assert sum(got.values()) == pytest.approx(10.0)  # the other thread is not counted
    assert (AVAILABLE.name, ("7", "python", "ok"), 1.0) in out


def test_idle_without_starvation_is_idle() -> None:
    samples = [StackSample(t / 10, 0.1, "T0:1", "app:loop") for t in range(1, 21, 2)]
    c = StacksCollector(lambda pid: FakeSampler(samples), idle_util=0.05, clock=lambda: 0.0)
    pts = [(k / 6, 0.0) for k in range(1, 13)]
    got = _seconds(_run(c, _ctx(2.0, pts, starved=False)))
    assert got == {("app:loop", "idle"): pytest.approx(1.0)}


def test_the_hottest_thread_is_the_one_that_ran_most_lately() -> None:
    early = [StackSample(t / 10, 0.1, "T0:1", "warmup:load") for t in range(1, 51)]
    late = [StackSample(60 + t / 10, 0.1, "T0:2", "serve:handle") for t in range(1, 31)]
    sampler = FakeSampler(early)
    c = StacksCollector(lambda pid: sampler, idle_util=0.05, clock=lambda: 0.0)
    _run(c, _ctx(5.0, [(k / 6, 0.9) for k in range(1, 31)], None))
    sampler.samples = late
    got = _seconds(_run(c, _ctx(63.0, [(60 + k / 6, 0.9) for k in range(1, 19)], None)))
    # Five seconds of T0:1 a minute ago weigh 5 * 2**-6 now: T0:2's three seconds win.
    assert got[("serve:handle", "busy")] == pytest.approx(3.0)


def test_a_target_on_two_gpus_is_busy_while_either_is_and_waits_for_the_later_timeline(
        ) -> None:
    """Mixed states. The target holds GPU0 (busy for 2 s, then idle) and GPU1 (idle
    throughout, its timeline a second behind); GPU2, busy, is someone else's. A moment is
    busy while any of the target's GPUs is, starved only while all of them idle, and a sample
    waits until every one of its GPUs has a reading past it."""
    samples = [StackSample(t / 10, 0.1, "T0:1", "app:work") for t in range(1, 41)]
    c = StacksCollector(lambda pid: FakeSampler(samples), idle_util=0.05, clock=lambda: 0.0)
    view = pass_view(4.0, (7,), processes={7: TargetState(7, "python", 0.5, 0.98)},
                     points={GPU0: [(k / 6, 0.9 if k <= 12 else 0.0) for k in range(1, 25)],
                             GPU1: [(k / 6, 0.0) for k in range(1, 19)],
                             GPU2: [(k / 6, 0.9) for k in range(1, 25)]},
                     util={GPU0: 0.0, GPU1: 0.0, GPU2: 0.9}, gpus_of_pid={7: {GPU0, GPU1}},
                     outputs=[Starvation({7: True})])
    got = _seconds(_run(c, view))
    assert got == {("app:work", "busy"): pytest.approx(2.0),
                   ("app:work", "starved"): pytest.approx(1.0)}


def test_samples_wait_for_the_gpu_timeline_to_cover_them() -> None:
    samples = [StackSample(t / 10, 0.1, "T0:1", "app:work") for t in range(1, 31)]
    c = StacksCollector(lambda pid: FakeSampler(samples), idle_util=0.05, clock=lambda: 0.0)
    got = _seconds(_run(c, _ctx(1.0, [(k / 6, 0.9) for k in range(1, 7)], None)))
    assert got == {("app:work", "busy"): pytest.approx(1.0)}  # up to t = 1.0 only
    got = _seconds(_run(c, _ctx(3.0, [(k / 6, 0.9) for k in range(7, 19)], None)))
    assert got == {("app:work", "busy"): pytest.approx(3.0)}


def test_functions_past_the_top_k_are_other_and_labels_never_move() -> None:
    samples = [StackSample(i / 10, 0.1, "T0:1", f"mod:f{i % 5}") for i in range(1, 11)]
    c = StacksCollector(lambda pid: FakeSampler(samples), idle_util=0.05, top_k=3,
                        clock=lambda: 0.0)
    got = _seconds(_run(c, _ctx(1.0, [(k / 6, 0.9) for k in range(1, 7)], None)))
    assert set(got) == {("mod:f1", "busy"), ("mod:f2", "busy"), ("mod:f3", "busy"),
                        ("other", "busy")}
    assert got[("other", "busy")] == pytest.approx(0.4)  # f4 and f0, twice each


def test_a_target_that_cannot_be_sampled_says_why_and_is_not_retried_for_rights() -> None:
    made: list[FakeSampler] = []

    def factory(pid: int) -> FakeSampler:
        made.append(FakeSampler([], StacksUnavailable("permission", "no ptrace"), alive=False))
        return made[-1]

    now = [0.0]
    c = StacksCollector(factory, idle_util=0.05, clock=lambda: now[0])
    _run(c, _ctx(1.0, [(1.0, 0.9)], None))
    out = _run(c, _ctx(2.0, [(2.0, 0.9)], None))
    assert (AVAILABLE.name, ("7", "python", "permission"), 0.0) in out
    now[0] = 1000.0
    _run(c, _ctx(3.0, [(3.0, 0.9)], None))
    assert len(made) == 1 and made[0].stopped == 1


def test_a_sampler_that_failed_is_tried_again_later_and_a_gone_target_stopped() -> None:
    made: list[FakeSampler] = []

    def factory(pid: int) -> FakeSampler:
        made.append(FakeSampler([], StacksUnavailable("failed", "crashed"),
                                alive=len(made) > 0))
        return made[-1]

    now = [0.0]
    c = StacksCollector(factory, idle_util=0.05, clock=lambda: now[0])
    _run(c, _ctx(1.0, [(1.0, 0.9)], None))
    assert (AVAILABLE.name, ("7", "python", "failed"), 0.0) in _run(
        c, _ctx(2.0, [(2.0, 0.9)], None))
    now[0] = 31.0
    assert (AVAILABLE.name, ("7", "python", "ok"), 1.0) in _run(
        c, _ctx(3.0, [(3.0, 0.9)], None))
    assert _run(c, _ctx(4.0, [(4.0, 0.9)], None, read=False)) == []
    assert len(made) == 2 and made[1].stopped == 1


def test_without_austin_every_target_says_missing() -> None:
    c = StacksCollector(None, idle_util=0.05,
                        unavailable=StacksUnavailable("missing", "austin is not installed"))
    assert _run(c, _ctx(1.0, [(1.0, 0.9)], None)) == [
        (AVAILABLE.name, ("7", "python", "missing"), 0.0)]


def test_the_collector_is_on_by_default() -> None:
    from mrc_agent.agent.core.collectors import DEFAULT_ON

    assert DEFAULT_ON["stacks"] is True


def test_missing_austin_is_said_once_for_the_agent_and_rights_once_per_target(caplog) -> None:
    missing = StacksCollector(None, idle_util=0.05,
                              unavailable=StacksUnavailable("missing", "austin is not installed"))
    refused = StacksCollector(
        lambda pid: FakeSampler([], StacksUnavailable("permission", "no ptrace"), alive=False),
        idle_util=0.05, clock=lambda: 0.0)
    with caplog.at_level("WARNING", logger="mrc_agent.agent.core.collectors.stacks"):
        for c in (missing, refused):
            for second, pid in enumerate((7, 7, 7, 8, 8), start=1):  # the target restarted
                _run(c, _ctx(float(second), [(float(second), 0.9)], None, pid=pid))
    said = [r.getMessage() for r in caplog.records]
    assert sum("austin is not installed" in m for m in said) == 1
    assert [m for m in said if "no ptrace" in m] == [
        "no stacks for pid 7: no ptrace", "no stacks for pid 8: no ptrace"]
