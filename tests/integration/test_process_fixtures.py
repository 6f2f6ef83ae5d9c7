"""The process collector and ProcFS over hand-written /proc trees (``tests/fixtures/proc/``, see
its README): exact ratios from tick deltas at a controlled monotonic time; no live processes,
no clocks, so nothing here depends on how busy the machine is.

ProcFS keeps the files it reads every pass open and re-reads them at offset 0, so the test does
not swap roots: one root under ``tmp_path`` becomes each moment in turn, in place. A file that
stays is rewritten (same inode: a kept descriptor reads the new content, as procfs answers a
re-read); a file of a process or thread that is gone is emptied before it is removed (a kept
procfs file of an exited process stops answering, while an unlinked regular file would go on
answering its old content). Every collector test runs with kept files and with none
(``max_open=0``), which must agree.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from mrc_agent.agent.core import targets
from mrc_agent.agent.core.collectors import process as process_collector
from mrc_agent.agent.core.collectors.base import Processes, TargetState, Update
from mrc_agent.agent.core.collectors.process import ProcessCollector, ratio
from mrc_agent.agent.core.hw import procfs
from mrc_agent.agent.core.hw.procfs import ProcFS
from mrc_agent.agent.core.sample import Value
from mrc_agent.agent.core.targets import Target, TargetResolver
from tests.support import pass_view, published

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "proc"
#: Monotonic time of each moment (the README's table).
NOW = {"t0": 1000.0, "t1": 1002.0, "t2": 1004.0, "t3": 1005.0}
BTIME = 1_700_000_000.0
PAGE = 4096
ALL = [100, 200, 300, 400, 700, 30]

USER = "mrc_process_cpu_user_ratio"
SYSTEM = "mrc_process_cpu_system_ratio"
HOTTEST = "mrc_process_hottest_thread_cpu_user_ratio"
SECONDS = "mrc_process_cpu_seconds_total"
RSS = "mrc_process_resident_memory_bytes"
THREADS = "mrc_process_threads"
SWITCHES = "mrc_process_context_switches_total"
START = "mrc_process_start_time_seconds"


@pytest.fixture(autouse=True)
def _user_hz(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trees count in USER_HZ = 100 and 4 KiB pages, whatever this host uses."""
    monkeypatch.setattr(procfs, "CLK_TCK", 100)
    monkeypatch.setattr(procfs, "PAGE_SIZE", PAGE)
    monkeypatch.setattr(process_collector, "CLK_TCK", 100, raising=False)


class ProcRoot:
    """A /proc root in ``tmp_path`` that becomes each fixture tree in turn, in place."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()

    def become(self, moment: str) -> None:
        src = FIXTURES / moment
        want = {p.relative_to(src) for p in src.rglob("*") if p.is_file()}
        have = {p.relative_to(self.path) for p in self.path.rglob("*") if p.is_file()}
        for rel in sorted(have - want):
            (self.path / rel).write_bytes(b"")  # a kept descriptor now reads nothing...
            (self.path / rel).unlink()  # ...and a fresh open finds nothing
        for d in sorted((p for p in self.path.rglob("*") if p.is_dir()), reverse=True):
            if not any(d.iterdir()):
                d.rmdir()
        for rel in sorted(want):
            (self.path / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.path / rel).write_bytes((src / rel).read_bytes())  # truncates in place


Out = dict[str, dict[tuple[str, ...], Value]]


def _processes(update: Update) -> dict[int, TargetState]:
    """What the process collector published of each target this pass."""
    processes = published(update, Processes)
    assert processes is not None
    return dict(processes.by_pid)


class Agent:
    """A ProcessCollector over a ProcRoot, sampled at the moments' monotonic times."""

    def __init__(self, root: ProcRoot, max_open: int, threads: bool = True) -> None:
        self.root = root
        self.fs = ProcFS(root=str(root.path), max_open=max_open)
        self.collector = ProcessCollector(procfs=self.fs, threads=threads)

    def sample(self, moment: str, pids: list[int] = ALL,
               now: float | None = None) -> tuple[dict[int, TargetState], Out]:
        """(what the pass published of each target, its series); ``now``: the monotonic time
        of the pass (default: the moment's own)."""
        self.root.become(moment)
        now = NOW[moment] if now is None else now
        update = self.collector.update(pass_view(now, pids, wall=BTIME + now))
        out: Out = {}
        for name, labels, value in update.samples:
            key = tuple(labels)
            assert key not in out.get(name, {}), (name, key)
            out.setdefault(name, {})[key] = value
        return _processes(update), out

    def kept(self, pid: int) -> list[str]:
        return sorted(p for p in self.fs._fds if p.startswith(f"{self.fs.root}/{pid}/"))


@pytest.fixture(params=[4096, 0], ids=["kept-files", "no-kept-files"])
def agent(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Agent]:
    a = Agent(ProcRoot(tmp_path / "proc"), request.param)
    yield a
    a.fs.close()


def pids(out: Out) -> set[int]:
    return {int(labels[0]) for series in out.values() for labels in series}


def approx(value: float) -> object:
    return pytest.approx(value, rel=0, abs=1e-12)


# --- the first pass: counters at once, ratios from the next pass on -----------------------------


def test_first_pass_has_counters_and_no_ratio(agent: Agent) -> None:
    procs, out = agent.sample("t0")
    assert USER not in out and SYSTEM not in out and HOTTEST not in out
    assert pids(out) == set(ALL)
    busy = ("100", "python3")
    assert out[SECONDS][busy + ("user",)] == approx(5.0)
    assert out[SECONDS][busy + ("system",)] == approx(0.2)
    assert out[RSS][busy] == 2560 * PAGE
    assert out[THREADS][busy] == 1
    assert out[SWITCHES][busy + ("voluntary",)] == 10
    assert out[SWITCHES][busy + ("involuntary",)] == 500
    assert out[START][busy] == approx(BTIME + 123.45)  # btime + starttime / USER_HZ
    assert out[THREADS][("300", "python3")] == 5
    assert procs[100].process == "python3" and procs[100].user_ratio is None
    assert procs[100].pid == 100 and procs[200].pid == 200
    assert procs[100].hottest_thread_user_ratio is None


def test_target_that_never_existed_gives_nothing(agent: Agent) -> None:
    procs, out = agent.sample("t0", [999])
    assert out == {} and procs == {}


# --- ratios from tick deltas -------------------------------------------------------------------


def test_user_and_system_ratio_from_tick_deltas(agent: Agent) -> None:
    agent.sample("t0")
    procs, out = agent.sample("t1")
    assert out[USER][("100", "python3")] == approx(0.9)  # +180 ticks in 2 s
    assert out[SYSTEM][("100", "python3")] == approx(0.1)  # +20
    assert out[USER][("300", "python3")] == approx(0.825)  # +165
    assert out[SYSTEM][("300", "python3")] == approx(0.05)  # +10
    assert out[SWITCHES][("100", "python3", "involuntary")] == 700
    assert procs[100].user_ratio == approx(0.9)
    assert procs[300].user_ratio == approx(0.825)


@pytest.mark.parametrize(("window", "user", "system"), [
    (0.5, 3.6, 0.4), (4.0, 0.45, 0.05), (10.0, 0.18, 0.02)])
def test_ratios_divide_by_the_measured_window(agent: Agent, window: float, user: float,
                                             system: float) -> None:
    """The same tick deltas over another window: the ratio is ticks / USER_HZ / the time
    between the two passes as measured, whatever the configured interval (a late pass must
    not read as a busier process). Above 1 is more than one core busy."""
    agent.sample("t0")
    procs, out = agent.sample("t1", now=NOW["t0"] + window)
    assert out[USER][("100", "python3")] == approx(user)
    assert out[SYSTEM][("100", "python3")] == approx(system)
    assert procs[100].user_ratio == approx(user)


def test_idle_process_reads_zero_and_comm_keeps_its_parentheses(agent: Agent) -> None:
    agent.sample("t0")
    _, out = agent.sample("t1")
    odd = ("200", "my (odd) proc")
    assert out[USER][odd] == 0.0 and out[SYSTEM][odd] == 0.0 and out[HOTTEST][odd] == 0.0
    assert out[SECONDS][odd + ("user",)] == approx(0.03)


def test_ratio_is_never_negative_and_zero_without_a_window() -> None:
    assert ratio(200, 2.0) == approx(1.0)
    assert ratio(-5, 1.0) == 0.0
    assert ratio(10, 0.0) == 0.0 and ratio(10, -1.0) == 0.0


# --- the hottest thread ------------------------------------------------------------------------


def test_hottest_thread_found_among_sleepers(agent: Agent) -> None:
    agent.sample("t0")
    procs, out = agent.sample("t1")
    # thread 301: +160 ticks in 2 s; the nappers +2, +2, +1; the main thread +0
    assert out[HOTTEST][("300", "python3")] == approx(0.8)
    assert procs[300].hottest_thread_user_ratio == approx(0.8)


def test_hottest_thread_is_clamped_to_the_process(agent: Agent) -> None:
    agent.sample("t0")
    _, out = agent.sample("t1")
    # the thread's stat, read after the process's, is one tick ahead: 181 / 2 s would be 0.905
    assert out[HOTTEST][("100", "python3")] == approx(0.9)
    assert out[HOTTEST][("100", "python3")] == out[USER][("100", "python3")]


def test_thread_born_in_the_window_counts_from_zero(agent: Agent) -> None:
    agent.sample("t0")
    if agent.fs._max_open:
        assert f"{agent.fs.root}/400/task/401/stat" in agent.fs._fds
    _, out = agent.sample("t1")
    pool = ("400", "pool")
    assert out[USER][pool] == approx(0.9)  # 110 -> 290: the exited thread's ticks stay counted
    # 402 was born in the window with 150 ticks: its whole life is in it (400 gained only 10)
    assert out[HOTTEST][pool] == approx(0.75)
    assert f"{agent.fs.root}/400/task/401/stat" not in agent.fs._fds  # the exited thread's file


def test_without_threads_no_hottest_series_and_no_thread_files(tmp_path: Path) -> None:
    agent = Agent(ProcRoot(tmp_path / "proc"), 4096, threads=False)
    agent.sample("t0")
    procs, out = agent.sample("t1")
    assert HOTTEST not in out
    assert out[USER][("300", "python3")] == approx(0.825)
    assert procs[300].hottest_thread_user_ratio is None
    assert not [p for p in agent.fs._fds if "/task/" in p]
    agent.fs.close()


# --- restarts, exits, zombies and kernel threads -----------------------------------------------


def test_restarted_pid_starts_afresh(agent: Agent) -> None:
    agent.sample("t0")
    agent.sample("t1")
    procs, out = agent.sample("t2", [100, 300])
    new = ("100", "python3")
    assert new not in out[USER] and new not in out[HOTTEST]  # no ratio across two processes
    assert procs[100].user_ratio is None
    assert out[SECONDS][new + ("user",)] == approx(0.3)  # the new process's own counters
    assert out[START][new] == approx(BTIME + 1003.0)
    assert out[USER][("300", "python3")] == approx(0.825)  # the other target is unaffected
    procs, out = agent.sample("t3", [100, 300])
    assert out[USER][new] == approx(0.9)  # +90 ticks in 1 s, from the restart's baseline
    assert out[SYSTEM][new] == 0.0
    assert out[HOTTEST][new] == approx(0.9)
    assert out[USER][("300", "python3")] == approx(0.8)
    assert procs[100].user_ratio == approx(0.9)


def test_vanished_targets_stop_producing_series_and_release_files(agent: Agent) -> None:
    agent.sample("t0")
    agent.sample("t1")
    procs, out = agent.sample("t2")
    assert pids(out) == {100, 300}
    assert set(procs) == {100, 300}
    for pid in (200, 400, 700, 30):
        assert agent.kept(pid) == [], pid
    if agent.fs._max_open:
        assert agent.kept(300)  # the live target keeps its files


def test_a_zombie_target_is_no_target(agent: Agent) -> None:
    """A target that exited is gone at once, reaped or not: no series, not counted in
    mrc_agent_targets (so MRCAgentTargetAbsent can fire)."""
    procs, out = agent.sample("t0")
    zombie = ("700", "worker")
    assert 700 in procs and zombie in out[RSS]  # alive at t0
    procs, out = agent.sample("t1")  # a zombie now
    assert 700 not in procs
    assert all(zombie not in series for series in out.values())
    _, out = agent.sample("t2", [700])
    assert out == {}  # reaped


def test_kernel_thread_reads_like_any_process(agent: Agent) -> None:
    agent.sample("t0")
    _, out = agent.sample("t1")
    kworker = ("30", "kworker/0:1-events")
    assert out[USER][kworker] == 0.0
    assert out[SYSTEM][kworker] == approx(0.02)  # +4 ticks of stime in 2 s
    assert out[HOTTEST][kworker] == 0.0
    assert out[RSS][kworker] == 0


# --- ProcFS and target discovery on one tree ---------------------------------------------------


def test_procfs_reads_a_tree() -> None:
    fs = ProcFS(root=str(FIXTURES / "t0"))
    assert sorted(fs.pids()) == [30, 100, 200, 300, 400, 600, 700]
    assert fs.boot_time() == BTIME
    assert fs.cmdline(300) == "python3 -m mrc.serve"
    assert fs.cmdline(30) == ""  # kernel threads have no command line
    st = fs.stat(200)
    assert st.comm == "my (odd) proc"
    assert (st.user_ticks, st.system_ticks, st.num_threads, st.start_ticks) == (3, 1, 1, 5000)
    assert st.rss_bytes == 1024 * PAGE
    assert fs.thread_user_ticks(300) == {300: 40, 301: 1000, 302: 20, 303: 20, 304: 20}
    assert fs.thread_schedstat(300)[301] == (10_000_000_000, 5_000_000)
    assert fs.context_switches(300) == (300, 80)
    fs.close()
    assert fs._fds == {}


def test_user_time_excludes_guest_time_like_pidstat() -> None:
    fs = ProcFS(root=str(FIXTURES / "t0"))
    st = fs.stat(600)  # utime 1000, delayacct_blkio_ticks 7, guest_time 400
    fs.close()
    assert st.system_ticks == 50
    assert st.user_ticks == 600


def test_name_regex_skips_kernel_threads_and_zombies() -> None:
    resolver = TargetResolver(process_name="worker",
                              procfs=ProcFS(root=str(FIXTURES / "t0")), self_pid=0)
    assert sorted(t.pid for t in resolver.resolve()) == [700]  # not kworker: no command line
    resolver = TargetResolver(process_name="worker",
                              procfs=ProcFS(root=str(FIXTURES / "t1")), self_pid=0)
    assert resolver.resolve() == []  # a zombie's command line is empty
    resolver = TargetResolver(process_name=r"^python3 ",
                              procfs=ProcFS(root=str(FIXTURES / "t0")), self_pid=300)
    assert sorted(t.pid for t in resolver.resolve()) == [100, 200]


def test_matched_process_stays_a_target_while_a_zombie(tmp_path: Path) -> None:
    """Command lines are cached per PID: a matched process that becomes a zombie stays a target
    until it is reaped (and then the collector finds nothing)."""
    root = ProcRoot(tmp_path / "proc")
    resolver = TargetResolver(process_name="worker", procfs=ProcFS(root=str(root.path)),
                              self_pid=0)
    for moment, want in (("t0", [700]), ("t1", [700]), ("t2", [])):
        root.become(moment)
        assert sorted(t.pid for t in resolver.resolve()) == want, moment


class CmdlineTree:
    """A /proc of command lines only, that a test rewrites (exec keeps the PID), and a count of
    the command-line reads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reads = 0
        self.fs = ProcFS(root=str(path))
        real = self.fs.cmdline

        def counted(pid: int) -> str:
            self.reads += 1
            return real(pid)

        self.fs.cmdline = counted  # type: ignore[method-assign]

    def set(self, pid: int, argv: str) -> None:
        (self.path / str(pid)).mkdir(parents=True, exist_ok=True)
        (self.path / str(pid) / "cmdline").write_bytes(argv.replace(" ", "\0").encode())

    def remove(self, pid: int) -> None:
        shutil.rmtree(self.path / str(pid))


def _resolver(tree: CmdlineTree, now: list[float], regex: str = "serve") -> TargetResolver:
    return TargetResolver(process_name=regex, procfs=tree.fs, self_pid=0, clock=lambda: now[0])


def test_a_child_read_before_its_exec_is_matched_after_the_exec(tmp_path: Path) -> None:
    """fork, then exec: a pass between the two reads the parent's command line in the child.
    The child is matched from the first re-read on, one FIRST_RECHECK_S later."""
    tree, now = CmdlineTree(tmp_path), [0.0]
    resolver = _resolver(tree, now)
    tree.set(500, "python3 -m pytest tests")  # forked, not yet exec'd
    assert resolver.resolve() == []
    tree.set(500, "python3 -m mrc.serve --port 8000")  # the exec
    for t in (0.1, 0.5, 0.9):
        now[0] = t
        assert resolver.resolve() == [], t  # cached until its re-read
    now[0] = targets.FIRST_RECHECK_S
    assert resolver.resolve() == [Target(500, "process_name")]


def test_an_entrypoint_that_execs_the_server_minutes_later_is_found(tmp_path: Path) -> None:
    tree, now = CmdlineTree(tmp_path), [0.0]
    resolver = _resolver(tree, now)
    tree.set(600, "/bin/sh /entrypoint.sh")
    t = 0.0
    while t < 300:  # five minutes of setup at 10 Hz
        now[0] = t
        assert resolver.resolve() == []
        t += 0.1
    tree.set(600, "python3 -m mrc.serve")
    exec_at, found_at = t, None
    while found_at is None and t < exec_at + 10:
        now[0] = t
        if resolver.resolve():
            found_at = t
        t += 0.1
    assert found_at is not None and found_at - exec_at <= targets.REFRESH_S + 0.1
    # Five minutes cost one read, one re-read and one every REFRESH_S, not 3,000 reads.
    assert tree.reads <= 2 + 300 / targets.REFRESH_S + 1


def test_a_matched_process_that_execs_something_else_is_dropped(tmp_path: Path) -> None:
    tree, now = CmdlineTree(tmp_path), [0.0]
    resolver = _resolver(tree, now)
    tree.set(700, "python3 -m mrc.serve")
    assert resolver.resolve() == [Target(700, "process_name")]
    tree.set(700, "/usr/bin/sleep 600")
    now[0] = targets.FIRST_RECHECK_S
    assert resolver.resolve() == []


def test_a_re_read_of_an_empty_command_line_keeps_the_target(tmp_path: Path) -> None:
    """A zombie (or a process mid-exec) reads as empty: it stays what it was."""
    tree, now = CmdlineTree(tmp_path), [0.0]
    resolver = _resolver(tree, now)
    tree.set(800, "python3 -m mrc.serve")
    assert resolver.resolve() == [Target(800, "process_name")]
    (tmp_path / "800" / "cmdline").write_bytes(b"")
    for t in (1.0, 10.0, 20.0):
        now[0] = t
        assert resolver.resolve() == [Target(800, "process_name")], t
    tree.remove(800)
    now[0] = 21.0
    assert resolver.resolve() == []


def test_re_reads_of_many_processes_are_spread_over_passes(tmp_path: Path) -> None:
    """1,000 processes at 10 Hz: after the first re-read, no pass re-reads more than a few
    percent of them (all 1,000 in one pass every REFRESH_S would be a latency spike)."""
    tree, now = CmdlineTree(tmp_path), [0.0]
    resolver = _resolver(tree, now)
    for pid in range(1000, 2000):
        tree.set(pid, f"worker {pid}")
    resolver.resolve()
    assert tree.reads == 1000
    per_pass = []
    for k in range(1, 300):  # 30 s
        now[0] = k / 10
        before = tree.reads
        resolver.resolve()
        per_pass.append(tree.reads - before)
    first_recheck = int(targets.FIRST_RECHECK_S * 10) - 1
    assert per_pass[first_recheck] == 1000
    later = per_pass[first_recheck + 1:]
    even = 1000 * 0.1 / targets.REFRESH_S  # 20 a pass
    assert max(later) <= 1.5 * even, max(later)
    # Every process is re-read once every REFRESH_S.
    assert abs(sum(later) - 1000 * 28.9 / targets.REFRESH_S) <= 1000


def test_fixture_sums_hold() -> None:
    """The trees are consistent: a process's utime is at least its live threads' (exited
    threads' ticks stay counted), give or take the one tick PID 100's thread is read ahead."""
    for moment in NOW:
        fs = ProcFS(root=str(FIXTURES / moment), max_open=0)
        for pid in fs.pids():
            st = fs.stat(pid)
            threads = fs.thread_user_ticks(pid)
            assert len(threads) == st.num_threads, (moment, pid)
            if pid != 600:  # threads' utime includes the guest time the process total drops
                assert sum(threads.values()) <= st.user_ticks + 1, (moment, pid)
        assert os.path.isfile(FIXTURES / moment / "stat")


# --- what the collector does on its own ----------------------------------------------------------


def test_threads_are_read_by_default(tmp_path: Path) -> None:
    root = ProcRoot(tmp_path / "proc")
    collector = ProcessCollector(procfs=ProcFS(root=str(root.path)))
    for moment in ("t0", "t1"):
        root.become(moment)
        view = pass_view(NOW[moment], (300,), wall=BTIME + NOW[moment])
        out = {(name, tuple(labels)): v for name, labels, v in collector.update(view).samples}
    assert out[(HOTTEST, ("300", "python3"))] == approx(0.8)


def test_start_time_is_boot_time_plus_start_ticks_even_at_the_epoch(tmp_path: Path) -> None:
    """A boot time of 0 (a clock that started at the epoch) is a boot time, not a missing one."""
    shutil.copytree(FIXTURES / "t0", tmp_path / "proc")
    stat = tmp_path / "proc" / "stat"
    stat.write_bytes(stat.read_bytes().replace(b"btime 1700000000", b"btime 0"))
    collector = ProcessCollector(procfs=ProcFS(root=str(tmp_path / "proc"), max_open=0))
    update = collector.update(pass_view(1000.0, (100,)))
    out = {(name, tuple(labels)): v for name, labels, v in update.samples}
    assert out[(START, ("100", "python3"))] == approx(123.45)


def test_a_process_whose_threads_all_vanished_mid_read_has_a_cold_hottest_thread(
        agent: Agent) -> None:
    """Its task directory lists nothing (every thread ended between the reads): no thread
    burnt a tick that pass, whatever the process total says."""
    agent.sample("t0", [100])
    agent.root.become("t1")
    thread = agent.root.path / "100" / "task" / "100"
    for f in thread.iterdir():
        f.write_bytes(b"")
        f.unlink()
    thread.rmdir()
    update = agent.collector.update(pass_view(NOW["t1"], (100,), wall=BTIME + NOW["t1"]))
    out = {(name, tuple(labels)): v for name, labels, v in update.samples}
    assert out[(USER, ("100", "python3"))] == approx(0.9)
    assert out[(HOTTEST, ("100", "python3"))] == 0.0
    assert _processes(update)[100].hottest_thread_user_ratio == 0.0


def test_a_zombie_on_the_first_pass_keeps_no_file_open(agent: Agent) -> None:
    procs, out = agent.sample("t1", [700, 300])
    assert 700 not in procs and pids(out) == {300}
    assert agent.kept(700) == []


def test_a_process_that_is_no_longer_a_target_releases_its_files(agent: Agent) -> None:
    agent.sample("t0", [100, 300])
    if agent.fs._max_open:
        assert agent.kept(300)
    procs, out = agent.sample("t1", [100])  # 300 runs on, but the resolver dropped it
    assert pids(out) == {100} and set(procs) == {100}
    assert agent.kept(300) == []
    if agent.fs._max_open:
        assert agent.kept(100)


def test_a_target_that_went_away_is_logged_with_the_reason(
        agent: Agent, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=process_collector.__name__)
    agent.sample("t0", [700])
    agent.sample("t1", [700])
    gone = [m for m in caplog.messages if "700" in m]
    assert len(gone) == 1 and "target 700 gone" in gone[0], caplog.messages
    assert "700 has exited (state Z)" in gone[0]
