"""The process collector against real processes the test spawns, and target discovery.

The exact logic (ratios from tick deltas, the hottest thread, restarts, exits, zombies, kernel
threads, parsing) is tested on fixture /proc trees in ``test_process_fixtures.py``. What is left
here is what only a live /proc shows, with margins that hold while other work keeps every core
busy: a spinning process is counted and an idle one is not, the ratio lies between what /proc
itself says just before and just after each pass, and kept files answer fresh and are released.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from mrc_agent.agent.core import targets
from mrc_agent.agent.core.collectors.base import PassView, Processes, TargetState
from mrc_agent.agent.core.collectors.process import ProcessCollector
from mrc_agent.agent.core.hw.procfs import CLK_TCK, ProcessGone, ProcFS
from mrc_agent.agent.core.targets import Target, TargetResolver
from tests.conftest import BUSY, IDLE, THREADED, Procs
from tests.support import published


def _pass(collector: ProcessCollector, targets: list[Target]
          ) -> tuple[Mapping[int, TargetState], dict]:
    """(what the pass published of each target, its series)."""
    update = collector.update(PassView(time.monotonic(), time.time(), tuple(targets)))
    processes = published(update, Processes)
    assert processes is not None
    return processes.by_pid, {(name, labels): value for name, labels, value in update.samples}


def _window(collector: ProcessCollector, targets: list[Target], seconds: float = 1.0):
    _pass(collector, targets)
    time.sleep(seconds)
    return _pass(collector, targets)


def _wait_for(what: str, ok: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll instead of sleeping a fixed time: a loaded machine starts Python slowly."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _threads(fs: ProcFS, pid: int) -> int:
    try:
        return fs.stat(pid).num_threads
    except ProcessGone:
        return 0


def _settled(fs: ProcFS, pid: int) -> None:
    """Wait until an idle child has finished starting up (its ticks stop moving)."""
    last: list[int] = []

    def still() -> bool:
        st = fs.stat(pid)
        now = st.user_ticks + st.system_ticks
        same = bool(last) and last[-1] == now
        last.append(now)
        time.sleep(0.2)
        return same

    _wait_for(f"{pid} to go idle", still)


def test_busy_process_is_counted_and_idle_is_not(procs: Procs) -> None:
    busy, idle = procs.spawn(BUSY), procs.spawn(IDLE)
    fs = ProcFS()
    _settled(fs, idle.pid)
    targets = [Target(busy.pid, "pid"), Target(idle.pid, "pid")]
    collector = ProcessCollector()
    procs_read, out = _window(collector, targets)
    comm = fs.stat(busy.pid).comm
    b, i = (str(busy.pid), comm), (str(idle.pid), comm)
    # A spinner gets some share of a core however loaded the machine is (0.1: ten ticks a
    # second, under a fair share even with eight busy processes on two cores); never more
    # than one core.
    assert 0.1 < out[("mrc_process_cpu_user_ratio", b)] <= 1.1
    assert out[("mrc_process_cpu_user_ratio", i)] <= 0.05
    hottest = out[("mrc_process_hottest_thread_cpu_user_ratio", b)]
    assert 0.1 < hottest <= out[("mrc_process_cpu_user_ratio", b)]
    assert out[("mrc_process_cpu_seconds_total", b + ("user",))] > 0.1
    assert out[("mrc_process_threads", b)] == 1
    assert out[("mrc_process_resident_memory_bytes", b)] > 1e6
    assert procs_read[busy.pid].user_ratio is not None
    fs.close()


def test_hottest_thread_found_among_sleepers(procs: Procs) -> None:
    p = procs.spawn(THREADED)
    fs = ProcFS()
    _wait_for("five threads", lambda: _threads(fs, p.pid) == 5)
    collector = ProcessCollector()
    _, out = _window(collector, [Target(p.pid, "pid")])
    labels = (str(p.pid), fs.stat(p.pid).comm)
    assert out[("mrc_process_threads", labels)] == 5
    hottest = out[("mrc_process_hottest_thread_cpu_user_ratio", labels)]
    total = out[("mrc_process_cpu_user_ratio", labels)]
    assert hottest > 0.1
    assert 0.5 * total <= hottest <= total  # the spinner is most of the process
    fs.close()


def test_ratio_lies_within_what_proc_says_around_the_window(procs: Procs) -> None:
    """Bracketed, so no tolerance: /proc is read (with the time) just before and just after
    each collector pass; the collector's ratio lies between the narrowest and the widest window
    those readings allow, however long the machine kept this test off a CPU in between."""
    p = procs.spawn(BUSY)
    fs, collector = ProcFS(), ProcessCollector()
    target = [Target(p.pid, "pid")]

    def bracketed() -> tuple[Mapping[int, TargetState], float, int, int, float]:
        t_before, u_before = time.monotonic(), fs.stat(p.pid).user_ticks
        read, _ = _pass(collector, target)
        u_after = fs.stat(p.pid).user_ticks
        return read, t_before, u_before, u_after, time.monotonic()

    bracketed()
    time.sleep(1.0)
    _, tb0, ub0, ua0, ta0 = bracketed()
    time.sleep(1.0)
    procs_read, tb1, ub1, ua1, ta1 = bracketed()
    got = procs_read[p.pid].user_ratio
    assert got is not None and got > 0.1
    low = (ub1 - ua0) / CLK_TCK / (ta1 - tb0)
    high = (ua1 - ub0) / CLK_TCK / (tb1 - ta0)
    assert low - 1e-9 <= got <= high + 1e-9, (low, got, high)
    fs.close()


def test_exited_target_disappears_and_first_pass_has_no_ratio(procs: Procs) -> None:
    p = procs.spawn(IDLE)
    collector = ProcessCollector()
    target = [Target(p.pid, "pid")]
    _, first = _pass(collector, target)
    assert not [k for k in first if k[0] == "mrc_process_cpu_user_ratio"]
    assert [k for k in first if k[0] == "mrc_process_cpu_seconds_total"]
    p.kill()
    p.wait()
    _, after = _pass(collector, target)
    assert after == {}


def test_kept_files_are_reread_fresh_and_released(procs: Procs) -> None:
    fs = ProcFS()
    p = procs.spawn(THREADED)
    _wait_for("five threads", lambda: len(fs.thread_user_ticks(p.pid)) == 5)
    first = fs.stat(p.pid).user_ticks
    # the kept file answers with fresh content
    _wait_for("fresh ticks", lambda: fs.stat(p.pid).user_ticks > first)
    kept = [path for path in fs._fds if f"/{p.pid}/" in path]
    assert len(kept) == 6  # the process's stat plus five threads' stat
    p.kill()
    p.wait()
    collector = ProcessCollector(procfs=fs)
    _pass(collector, [Target(p.pid, "pid")])
    assert not [path for path in fs._fds if f"/{p.pid}/" in path]


def test_pidfile_follows_a_restarted_service(procs: Procs, tmp_path) -> None:
    pidfile = tmp_path / "svc.pid"
    first = procs.spawn(IDLE)
    pidfile.write_text(f"{first.pid}\n")
    resolver = TargetResolver(pidfile=str(pidfile))
    assert [t.pid for t in resolver.resolve()] == [first.pid]
    first.kill()
    second = procs.spawn(IDLE)
    pidfile.write_text(f"{second.pid}\n")
    assert [t.pid for t in resolver.resolve()] == [second.pid]
    pidfile.write_text("garbage")
    assert resolver.resolve() == []  # unreadable at run time: no target, no crash


def test_process_name_regex_follows_an_entrypoint_that_execs_the_server(tmp_path) -> None:
    """A real ``sh entrypoint.sh`` that sets up for a while, then execs the server under the
    same PID: found within one refresh of the exec, as the same PID."""
    marker = f"mrc-exec-marker-{os.getpid()}"
    entry = tmp_path / "entrypoint.sh"
    entry.write_text(f"sleep 1\nexec {sys.executable} -c 'import time; time.sleep(30)' "
                     f"{marker}\n")
    shell = subprocess.Popen(["sh", str(entry)])
    try:
        resolver = TargetResolver(process_name=marker)
        assert resolver.resolve() == []  # still the shell
        deadline = time.monotonic() + 1 + targets.REFRESH_S + 5
        found: list[int] = []
        while not found and time.monotonic() < deadline:
            found = [t.pid for t in resolver.resolve()]
            time.sleep(0.1)
        assert found == [shell.pid]
    finally:
        shell.kill()
        shell.wait()


def test_process_name_regex_finds_each_match_but_not_itself(procs: Procs) -> None:
    marker = f"mrc-test-marker-{os.getpid()}"
    a = procs.spawn(IDLE, 60.0, marker)
    b = procs.spawn(IDLE, 60.0, marker)
    time.sleep(0.2)
    resolver = TargetResolver(process_name=marker)
    found = {t.pid for t in resolver.resolve()}
    assert found == {a.pid, b.pid}
    assert os.getpid() not in found
    a.kill()
    a.wait()
    c = procs.spawn(IDLE, 60.0, marker)
    time.sleep(0.2)
    assert {t.pid for t in resolver.resolve()} == {b.pid, c.pid}
