"""The stacks collector on a real process: a real austin child sampling a Python program whose
phases follow a GPU timeline fed to the collector, its culprit known."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mrc_agent.agent.core.collectors.base import (
    BuildContext,
    StackSettings,
    TargetState,
)
from mrc_agent.agent.core.collectors.derived import Starvation
from mrc_agent.agent.core.collectors.stacks import (
    AVAILABLE,
    DEFINITION,
    FUNCTION_SECONDS,
    StacksCollector,
)
from tests.support import GPU0, pass_view

PROGRAM = textwrap.dedent("""\
    import sys, time

    def decode_and_resize(until):
        x = 0
        while time.monotonic() < until:
            busy = time.monotonic() + 0.01
            while time.monotonic() < busy:  # the culprit: CPU-bound, in Python
                x += 1
            time.sleep(0.01)  # leaves the cores to others: half duty

    print("ready", flush=True)
    while True:
        decode_and_resize(time.monotonic() + 1.0)
""")


@pytest.fixture
def target(tmp_path: Path):
    (tmp_path / "culprit_mod.py").write_text(PROGRAM)
    proc = subprocess.Popen([sys.executable, "-c", "import culprit_mod"], cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def test_a_real_austin_names_the_function_the_target_ran_while_its_gpu_starved(
        target: subprocess.Popen[str]) -> None:
    collector = DEFINITION.factory(BuildContext(stacks=StackSettings(interval=0.05)))
    assert isinstance(collector, StacksCollector)
    pid = target.pid
    t0 = time.monotonic()
    out: list = []
    got: dict[tuple[str, str], float] = {}
    try:
        for _ in range(150):  # up to 15 s of passes, every 0.1 s (a loaded machine)
            time.sleep(0.1)
            now = time.monotonic()
            # The GPU idles the whole time and the target is starved: points every 0.05 s.
            view = pass_view(
                now, (pid,), wall=time.time(),
                processes={pid: TargetState(pid, "python", 0.5, 0.95)},
                points={GPU0: [(t0 + k * 0.05, 0.0) for k in range(int((now - t0) / 0.05) + 1)]},
                util={GPU0: 0.0}, outputs=[Starvation({pid: True})])
            out = collector.update(view).samples
            got = {(labels[2], labels[3]): float(v) for name, labels, v in out  # type: ignore[arg-type]
                   if name == FUNCTION_SECONDS.name}
            if got.get(("culprit_mod:decode_and_resize", "starved"), 0.0) >= 1.0:
                break
    finally:
        collector.close()
    assert (AVAILABLE.name, (str(pid), "python", "ok"), 1.0) in out
    assert got.get(("culprit_mod:decode_and_resize", "starved"), 0.0) >= 1.0, got
    # Every second counted is the culprit's (or its caller's, sampled between two calls);
    # none is busy or idle: the GPU idled, the target starved, throughout.
    assert set(got) <= {("culprit_mod:decode_and_resize", "starved"),
                        ("culprit_mod:<module>", "starved")}, got


def test_a_process_that_is_not_python_is_said_so(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "30"])
    collector = DEFINITION.factory(BuildContext(stacks=StackSettings(interval=0.05)))
    assert isinstance(collector, StacksCollector)
    try:
        out: list = []
        for _ in range(150):
            time.sleep(0.1)
            view = pass_view(time.monotonic(), (proc.pid,), wall=time.time(),
                             processes={proc.pid: TargetState(proc.pid, "sleep", 0.0, 0.0)})
            out = collector.update(view).samples
            if (AVAILABLE.name, (str(proc.pid), "sleep", "not_python"), 0.0) in out:
                break
        assert (AVAILABLE.name, (str(proc.pid), "sleep", "not_python"), 0.0) in out, out
    finally:
        collector.close()
        proc.kill()
        proc.wait()


def test_a_sampler_that_ended_is_running_until_it_has_said_why(tmp_path: Path) -> None:
    """The collector reads the reason once the sampler stops running. austin's exit was seen
    before the reader thread had read its stderr, and on a loaded machine the reason came out
    as "failed: austin stopped" (retried every 30 s) instead of "not_python" (said once)."""
    from mrc_agent.agent.core.stacks import StackSampler

    fake = tmp_path / "austin"
    # Exits at once, then its output ends only after a moment: the window of the race.
    fake.write_text("#!/bin/sh\necho 'Cannot attach: not a Python process' >&2\n"
                    "(sleep 0.5) &\nexit 32\n")
    fake.chmod(0o755)
    sampler = StackSampler(str(fake), pid=os.getpid(), interval=0.1)
    sampler.start()
    try:
        deadline = time.monotonic() + 15
        while sampler.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not sampler.running()
        assert sampler.error is not None and sampler.error.reason == "not_python", sampler.error
    finally:
        sampler.stop()


def test_the_default_run_without_austin_says_missing_once_and_the_rest_runs_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``mrc-agent run`` as configured by default (the stacks collector on) where austin is
    nowhere to be found: each target's available series says missing, the log says it once
    across passes and targets, and the process collector's values come as before."""
    from mrc_agent.agent.core.collectors import PASS_FINISHERS
    from mrc_agent.agent.core.config import AgentConfig
    from mrc_agent.agent.core.hw.sources import Sources
    from mrc_agent.agent.core.runner import Runner
    from mrc_agent.agent.core.targets import TargetResolver
    from mrc_agent.agent.core.wiring import build_collectors

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]
    # Neither beside this Python nor on PATH.
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    cfg = AgentConfig(pids=[p.pid for p in procs], gpu_backend="none")
    assert cfg.collectors["stacks"] and "stacks" in cfg.enabled
    runner = Runner(build_collectors(cfg, Sources()), TargetResolver(cfg.pids), 0.2,
                    finishers=PASS_FINISHERS)
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(4):
                snap = runner.sample_once()
        by_name: dict[str, list] = {}
        for name, labels, value in snap.samples:
            by_name.setdefault(name, []).append((labels, value))
        assert {(labels[0], labels[2], v) for labels, v in by_name[AVAILABLE.name]} == {
            (str(p.pid), "missing", 0.0) for p in procs}
        said = [r.getMessage() for r in caplog.records if "no stacks" in r.getMessage()]
        assert len(said) == 1 and "austin is not installed" in said[0], said
        assert {labels[0] for labels, _ in by_name["mrc_process_cpu_user_ratio"]} == {
            str(p.pid) for p in procs}
        health = {labels[0]: v for labels, v in by_name["mrc_agent_collector_success"]}
        assert health["process"] == 1.0 and health["stacks"] == 1.0, health
    finally:
        runner.stop()
        for p in procs:
            p.kill()
            p.wait()
