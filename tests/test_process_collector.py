"""The process collector against real processes the test spawns, and target discovery."""

from __future__ import annotations

import os
import time

from agent.core.collectors.base import SampleContext
from agent.core.collectors.process import ProcessCollector
from agent.core.hw.procfs import CLK_TCK, ProcFS, parse_stat
from agent.core.targets import Target, TargetResolver
from tests.conftest import BUSY, IDLE, THREADED, Procs


def _pass(collector: ProcessCollector, targets: list[Target]) -> tuple[SampleContext, dict]:
    ctx = SampleContext(now=time.monotonic(), wall=time.time(), targets=targets)
    samples = collector.update(ctx)
    return ctx, {(name, labels): value for name, labels, value in samples}


def _window(collector: ProcessCollector, targets: list[Target], seconds: float = 1.0):
    _pass(collector, targets)
    time.sleep(seconds)
    return _pass(collector, targets)


def test_parse_stat_handles_spaces_and_parens_in_comm() -> None:
    fields = ["S"] + ["0"] * 50
    fields[11], fields[12] = "250", "40"  # utime, stime
    fields[17], fields[19], fields[21] = "7", "12345", "100"  # threads, starttime, rss pages
    fields[39] = "50"  # guest_time: pidstat takes it out of user time
    raw = b"42 (my (odd) proc) " + " ".join(fields).encode()
    st = parse_stat(42, raw)
    assert st.comm == "my (odd) proc"
    assert st.user_ticks == 200 and st.system_ticks == 40
    assert st.num_threads == 7 and st.start_ticks == 12345
    assert st.rss_bytes == 100 * os.sysconf("SC_PAGE_SIZE")


def test_busy_process_reads_one_core_and_idle_reads_zero(procs: Procs) -> None:
    busy, idle = procs.spawn(BUSY), procs.spawn(IDLE)
    time.sleep(0.3)
    targets = [Target(busy.pid, "pid"), Target(idle.pid, "pid")]
    collector = ProcessCollector()
    ctx, out = _window(collector, targets)
    comm = ProcFS().stat(busy.pid).comm
    b, i = (str(busy.pid), comm), (str(idle.pid), comm)
    assert 0.9 <= out[("mrc_process_cpu_user_ratio", b)] <= 1.05
    assert out[("mrc_process_cpu_user_ratio", i)] <= 0.05
    assert 0.9 <= out[("mrc_process_hottest_thread_cpu_user_ratio", b)] <= 1.05
    assert out[("mrc_process_cpu_seconds_total", b + ("user",))] > 0.5
    assert out[("mrc_process_threads", b)] == 1
    assert out[("mrc_process_resident_memory_bytes", b)] > 1e6
    assert ctx.processes[busy.pid].user_ratio is not None


def test_hottest_thread_found_among_sleepers(procs: Procs) -> None:
    p = procs.spawn(THREADED)
    time.sleep(0.5)
    collector = ProcessCollector()
    _, out = _window(collector, [Target(p.pid, "pid")])
    labels = (str(p.pid), ProcFS().stat(p.pid).comm)
    assert out[("mrc_process_threads", labels)] == 5
    assert 0.85 <= out[("mrc_process_hottest_thread_cpu_user_ratio", labels)] <= 1.05


def test_ratio_matches_proc_ground_truth(procs: Procs) -> None:
    p = procs.spawn(BUSY)
    time.sleep(0.2)
    fs, collector = ProcFS(), ProcessCollector()
    target = [Target(p.pid, "pid")]
    _pass(collector, target)
    t0, u0 = time.monotonic(), fs.stat(p.pid).user_ticks
    time.sleep(1.0)
    ctx, out = _pass(collector, target)
    truth = (fs.stat(p.pid).user_ticks - u0) / CLK_TCK / (time.monotonic() - t0)
    assert abs(ctx.processes[p.pid].user_ratio - truth) <= 0.05


def test_exited_target_disappears_and_first_pass_has_no_ratio(procs: Procs) -> None:
    p = procs.spawn(IDLE)
    time.sleep(0.1)
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
    time.sleep(0.3)
    first = fs.stat(p.pid).user_ticks
    assert len(fs.thread_user_ticks(p.pid)) == 5
    time.sleep(0.5)
    assert fs.stat(p.pid).user_ticks > first  # the kept file answers with fresh content
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
