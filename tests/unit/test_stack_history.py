"""The agent's own stack samples as the captures read them: whole stacks kept by the sampler for
a while, handed out by the stacks collector, turned into collapsed stacks and a flame graph."""

from __future__ import annotations

import io
from typing import Any

import pytest

from mrc_agent.agent.core import stacks as stacks_mod
from mrc_agent.agent.core.collectors.stacks import StacksCollector
from mrc_agent.agent.core.stacks import SampleParser, StackSample, StackSampler
from mrc_agent.agent.tools.diagnose import flamegraph
from mrc_agent.agent.tools.diagnose.stacks import (
    austin_frame,
    collapsed,
    from_samples,
    parse_collapsed,
    top_functions,
)
from tests.support import FakeSampler
from tests.unit.test_stacks import AUSTIN_OUTPUT, _ctx

RESIZE = "/srv/app/preprocess.py:resize_image:41"
MODULE = "/srv/app/server.py:<module>:3"


def parsed(text: str = AUSTIN_OUTPUT) -> list[StackSample]:
    parser = SampleParser(max_seconds=0.3)
    return [s for k, line in enumerate(text.splitlines(keepends=True))
            if (s := parser.line(line, float(k))) is not None]


def test_a_sample_keeps_its_whole_stack_less_unreadable_frames() -> None:
    got = parsed()
    assert [s.frames for s in got] == [
        (MODULE, RESIZE),
        ("/usr/lib/python3.11/threading.py:Thread.run:982",),
        (MODULE, "/srv/app/preprocess.py:resize_image:44"),
        (MODULE,),
        ("/usr/lib/python3.11/threading.py:Thread.run:982",),
    ]
    # A stack seen again is the same tuple, not a copy: the history holds it once.
    parser = SampleParser()
    a = parser.line(f"P7;T0:7;{MODULE};{RESIZE} 100\n", 1.0)
    b = parser.line(f"P7;T0:7;{MODULE};{RESIZE} 100\n", 2.0)
    assert a is not None and b is not None and a.frames is b.frames


class _Proc:
    def wait(self) -> int:
        return 0


def sampler_fed(lines: str, monkeypatch: pytest.MonkeyPatch | None = None,
                keep: int | None = None) -> StackSampler:
    """A sampler whose reader has read ``lines`` as austin's output, one a second."""
    if keep is not None and monkeypatch is not None:
        monkeypatch.setattr(stacks_mod, "MAX_HISTORY", keep)
    ticks = iter(range(1000))
    sampler = StackSampler("austin", 7, 0.1, clock=lambda: float(next(ticks)))
    sampler._read(_Proc(), io.StringIO(lines))  # type: ignore[arg-type]
    return sampler


def test_the_history_outlives_take_and_is_read_by_time() -> None:
    sampler = sampler_fed(AUSTIN_OUTPUT)
    taken = sampler.take()
    assert len(taken) == 5 and sampler.take() == []
    assert sampler.history(0.0) == taken  # still there for a capture
    assert [s.t for s in sampler.history(2.0)] == [s.t for s in taken if s.t >= 2.0]
    assert sampler.history(1e9) == []


def test_the_history_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = "".join(f"P7;T0:7;{MODULE};/srv/app/m.py:f{k}:1 100000\n" for k in range(50))
    sampler = sampler_fed(lines, monkeypatch, keep=8)
    kept = sampler.history(0.0)
    assert len(kept) == 8 and kept[-1].function == "m:f49" and kept[0].function == "m:f42"


def test_the_collector_hands_out_a_sampled_targets_history_only() -> None:
    samples = [StackSample(1.0, 0.1, "T0:1", "preprocess:resize_image", (MODULE, RESIZE)),
               StackSample(2.0, 0.1, "T0:1", "preprocess:resize_image", (MODULE, RESIZE))]
    sampler = FakeSampler(samples)
    c = StacksCollector(lambda pid: sampler, idle_util=0.05, clock=lambda: 0.0)
    assert c.history(7, 0.0) is None  # no pass yet: not sampled
    c.update(_ctx(3.0, [(2.5, 0.0)], starved=True))
    assert c.history(7, 0.0) == samples and c.history(7, 1.5) == samples[1:]
    assert c.history(8, 0.0) is None  # not a target
    sampler.alive = False
    assert c.history(7, 0.0) is None  # austin ended: a capture samples for itself
    without = StacksCollector(None, idle_util=0.05)
    without.update(_ctx(3.0, [(2.5, 0.0)], starved=True))
    assert without.history(7, 0.0) is None


@pytest.mark.parametrize(("frame", "function", "file", "line"), [
    (RESIZE, "resize_image", "/srv/app/preprocess.py", 41),
    ("<frozen runpy>:_run_code:88", "_run_code", "<frozen runpy>", 88),
    ("C:\\odd:f:1", "f", "C:\\odd", 1),
    ("/x.py:A.f.<locals>.<listcomp>:9", "A.f.<locals>.<listcomp>", "/x.py", 9),
    ("nothing", "nothing", "", None),
])
def test_austins_frames_read_as_frames(frame: str, function: str, file: str,
                                       line: int | None) -> None:
    f = austin_frame(frame)
    assert (f.function, f.file, f.line) == (function, file, line)


def test_samples_collapse_per_thread_and_stack_and_read_back() -> None:
    got = from_samples(parsed())
    assert [(s.thread, [f.line for f in s.frames], s.count) for s in got] == [
        ("thread 7", [3], 1), ("thread 7", [3, 41], 1), ("thread 7", [3, 44], 1),
        ("thread 9", [982], 2)]
    text = collapsed(got)
    assert text.splitlines()[0] == "thread (7);<module> (/srv/app/server.py:3) 1"
    back = parse_collapsed(text)
    assert [(s.thread, s.frames, s.count) for s in back] == [
        (s.thread, s.frames, s.count) for s in got]
    assert collapsed([]) == "" and from_samples([]) == []


def test_the_top_functions_of_the_agents_samples_count_at_its_rate() -> None:
    hot = [StackSample(k / 10, 0.1, "T0:7", "preprocess:resize_image", (MODULE, RESIZE))
           for k in range(30)]
    cold = [StackSample(k, 0.1, "T0:7", "server:<module>", (MODULE,)) for k in range(5)]
    top = top_functions(from_samples(hot + cold), rate=10.0)
    assert top["self"][0]["function"] == "resize_image"
    assert top["self"][0]["self_samples"] == 30 and top["self"][0]["self_seconds"] == 3.0
    assert top["total"][0]["function"] == "<module>"
    assert top["total"][0]["total_samples"] == 35


def _boxes(svg: str) -> dict[str, float]:
    import re

    out: dict[str, float] = {}
    for tip, width in re.findall(r"<title>([^<]*) \(\d+ samples[^<]*</title><rect [^>]*"
                                 r'width="([\d.]+)"', svg):
        out[tip] = out.get(tip, 0.0) + float(width)
    return out


def test_the_flame_graph_is_as_wide_as_the_samples_and_escapes_names() -> None:
    stacks = parse_collapsed("thread (7);main (/a.py:1);resize_image (/p.py:4) 3\n"
                             "thread (7);main (/a.py:1);<lambda> (/p.py:9) 1\n"
                             "thread (9);run (/t.py:2) 4\n")
    svg = flamegraph.render(stacks, 'pid 7 & "friends"')
    boxes = _boxes(svg)
    assert boxes["all"] == pytest.approx(flamegraph.WIDTH)
    assert boxes["main (/a.py:1)"] == pytest.approx(flamegraph.WIDTH / 2)
    assert boxes["resize_image (/p.py:4)"] == pytest.approx(flamegraph.WIDTH * 3 / 8)
    assert boxes["run (/t.py:2)"] == pytest.approx(flamegraph.WIDTH / 2)
    assert "&lt;lambda&gt;" in svg and "<lambda>" not in svg and "pid 7 &amp;" in svg
    assert svg.startswith("<?xml") and svg.rstrip().endswith("</svg>")
    # The outermost frame is the lowest box: deeper frames sit higher.
    ys = {name: float(y) for name, y in __import__("re").findall(
        r'<title>([^<]*) \(\d+ samples[^<]*</title><rect x="[\d.]+" y="(\d+)"', svg)}
    assert ys["all"] > ys["main (/a.py:1)"] > ys["resize_image (/p.py:4)"]


def test_an_empty_window_draws_a_graph_that_says_so(tmp_path: Any) -> None:
    path = tmp_path / "flamegraph.svg"
    flamegraph.write(str(path), [], "pid 7")
    text = path.read_text()
    assert "No samples" in text and "<rect" not in text
