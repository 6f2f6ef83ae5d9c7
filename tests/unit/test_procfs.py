"""ProcFS (``agent/core/hw/procfs.py``) on its own: the ``stat`` parser on lines the fixture trees
do not hold (short, malformed, undecodable), what each failure says (``mrc-agent doctor`` shows
it), and the kept files: one open per file, re-read from the start, bounded, closed when they
stop answering or when ProcFS closes. Small trees under ``tmp_path``; no live process is read
except this test's own, for the default root.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mrc_agent.agent.core.hw import procfs
from mrc_agent.agent.core.hw.procfs import ProcessGone, ProcFS, is_pid, parse_stat

PAGE = 4096


@pytest.fixture(autouse=True)
def _page_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procfs, "PAGE_SIZE", PAGE)


def stat_line(pid: int, comm: bytes = b"python3", state: bytes = b"S", utime: int = 0,
              stime: int = 0, threads: int = 1, start: int = 0, rss: int = 0, guest: int = 0,
              fields: int = 50) -> bytes:
    """A ``/proc/PID/stat`` line with ``fields`` fields after the comm (50 on a current kernel;
    proc(5) field N is index N - 3)."""
    rest = [b"0"] * fields
    for index, value in ((11, utime), (12, stime), (17, threads), (19, start), (21, rss),
                         (40, guest)):
        if index < fields:
            rest[index] = str(value).encode()
    rest[0] = state
    return b"%d (%s) %s\n" % (pid, comm, b" ".join(rest))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as exc:
        assert exc.errno == errno.EBADF
        return False
    return True


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A tree with one process, 5 (two threads, 5 and 6), and ``btime``."""
    r = tmp_path / "proc"
    (r / "5" / "task" / "5").mkdir(parents=True)
    (r / "5" / "task" / "6").mkdir()
    (r / "stat").write_bytes(b"cpu  1 2 3 4\nbtime 1700000000\nprocesses 9\n")
    (r / "5" / "stat").write_bytes(stat_line(5, utime=300, stime=20, threads=2, start=77,
                                             rss=10))
    (r / "5" / "status").write_bytes(b"Name:\tpython3\nvoluntary_ctxt_switches:\t3\n"
                                     b"nonvoluntary_ctxt_switches:\t4\n")
    (r / "5" / "cmdline").write_bytes(b"python3\0serve.py\0")
    for tid, ticks in ((5, 100), (6, 200)):
        (r / "5" / "task" / str(tid) / "stat").write_bytes(stat_line(tid, utime=ticks))
        (r / "5" / "task" / str(tid) / "schedstat").write_bytes(b"%d 7 1\n" % (ticks * 10))
    return r


@pytest.fixture
def fs(root: Path) -> Iterator[ProcFS]:
    f = ProcFS(root=str(root))
    yield f
    f.close()


# --- the stat parser ---------------------------------------------------------------------------


def test_a_current_stat_line_gives_every_field() -> None:
    st = parse_stat(42, stat_line(42, utime=1000, stime=50, threads=3, start=999, rss=7,
                                  guest=400, state=b"R"))
    assert (st.pid, st.comm, st.state) == (42, "python3", "R")
    assert (st.user_ticks, st.system_ticks, st.num_threads, st.start_ticks) == (600, 50, 3, 999)
    assert st.rss_bytes == 7 * PAGE
    assert not st.exited


def test_a_stat_line_without_guest_time_counts_no_guest_time() -> None:
    """Kernels before 2.6.24 stop at field 42 (40 fields after the comm); field 43 is read
    wherever it exists, the last field of the line included."""
    assert parse_stat(1, stat_line(1, utime=500, fields=40)).user_ticks == 500
    assert parse_stat(1, stat_line(1, utime=500, guest=100, fields=41)).user_ticks == 400


def test_user_ticks_are_never_negative() -> None:
    assert parse_stat(1, stat_line(1, utime=0)).user_ticks == 0
    assert parse_stat(1, stat_line(1, utime=10, guest=25)).user_ticks == 0


@pytest.mark.parametrize("raw", [b"", b"42 python3 R 1 2 3", b"42 (python3 R 1 2 3 4 5 6 7 8 9 10",
                                 b"42 python3) R 1 2 3 4 5 6 7 8 9 10"])
def test_a_stat_line_without_its_parentheses_is_an_unexpected_format(raw: bytes) -> None:
    with pytest.raises(ProcessGone) as info:
        parse_stat(42, raw)
    assert str(info.value) == "/proc/42/stat: unexpected format"


def test_undecodable_comm_and_state_bytes_are_replaced_not_fatal() -> None:
    """The kernel cuts comm at 15 bytes, which can split a UTF-8 character."""
    st = parse_stat(9, stat_line(9, comm=b"caf\xc3", state=b"\xff"))
    assert st.comm == "caf\ufffd"
    assert st.state == "\ufffd"


# --- what each failure says --------------------------------------------------------------------


def test_a_missing_process_names_the_file_and_the_reason(fs: ProcFS, root: Path) -> None:
    with pytest.raises(ProcessGone) as info:
        fs.stat(999)
    assert str(info.value) == f"{root}/999/stat: No such file or directory"
    with pytest.raises(ProcessGone) as info:
        fs.cmdline(999)
    assert str(info.value) == f"{root}/999/cmdline: No such file or directory"
    assert fs._fds == {}


def test_an_unreadable_file_names_the_file_and_the_error(fs: ProcFS, root: Path) -> None:
    (root / "5" / "cmdline").unlink()
    (root / "5" / "cmdline").mkdir()  # read() fails with EISDIR, not ENOENT
    with pytest.raises(ProcessGone) as info:
        fs.cmdline(5)
    path = f"{root}/5/cmdline"
    assert str(info.value) == f"{path}: [Errno 21] Is a directory: '{path}'"


def test_a_process_without_its_task_directory_is_gone(fs: ProcFS, root: Path) -> None:
    for tid in ("5", "6"):
        for name in ("stat", "schedstat"):
            (root / "5" / "task" / tid / name).unlink()
        (root / "5" / "task" / tid).rmdir()
    (root / "5" / "task").rmdir()
    with pytest.raises(ProcessGone) as info:
        fs.thread_user_ticks(5)
    assert str(info.value) == f"{root}/5/task: No such file or directory"
    assert fs.thread_schedstat(5) == {}


def test_no_btime_in_stat_is_said(fs: ProcFS, root: Path) -> None:
    assert fs.boot_time() == 1_700_000_000.0
    (root / "stat").write_bytes(b"cpu  1 2 3 4\nprocesses 9\n")
    with pytest.raises(ProcessGone) as info:
        fs.boot_time()
    assert str(info.value) == f"{root}/stat: no btime"


# --- the other files ---------------------------------------------------------------------------


def test_stat_reads_the_pid_it_was_asked_for(fs: ProcFS) -> None:
    st = fs.stat(5)
    assert (st.pid, st.user_ticks, st.system_ticks, st.num_threads) == (5, 300, 20, 2)
    assert (st.start_ticks, st.rss_bytes) == (77, 10 * PAGE)


def test_a_status_without_context_switch_lines_counts_none(fs: ProcFS, root: Path) -> None:
    assert fs.context_switches(5) == (3, 4)
    (root / "5" / "status").write_bytes(b"Name:\tpython3\nThreads:\t2\n")
    fresh = ProcFS(root=str(root))
    assert fresh.context_switches(5) == (0, 0)
    fresh.close()


def test_an_undecodable_command_line_is_replaced_not_fatal(fs: ProcFS, root: Path) -> None:
    (root / "5" / "cmdline").write_bytes(b"python3\0caf\xe9.py\0")  # a Latin-1 file name
    assert fs.cmdline(5) == "python3 caf\ufffd.py"


def test_the_default_root_is_the_live_proc() -> None:
    live = ProcFS()
    assert live.root == "/proc"
    assert os.getpid() in live.pids()
    assert live.stat(os.getpid()).pid == os.getpid()
    live.close()


def _first(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``os.listdir`` list ``bad`` first, so that a loop that stopped at it would miss the
    threads after it (directory order is otherwise the filesystem's)."""
    real = os.listdir
    monkeypatch.setattr(procfs.os, "listdir",
                        lambda path: sorted(real(path), key=lambda name: (name != bad, name)))


def test_a_thread_that_ends_mid_read_is_skipped_and_the_rest_are_read(
        fs: ProcFS, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (root / "5" / "task" / "4").mkdir()  # listed, but its files are already gone
    (root / "5" / "task" / "x").mkdir()  # not a thread id
    (root / "5" / "task" / "x" / "stat").write_bytes(stat_line(5))
    (root / "5" / "task" / "x" / "schedstat").write_bytes(b"1 2 3\n")
    for bad in ("4", "x"):
        _first(bad, monkeypatch)
        assert fs.thread_user_ticks(5) == {5: 100, 6: 200}, bad
        assert fs.thread_schedstat(5) == {5: (1000, 7), 6: (2000, 7)}, bad
    (root / "5" / "task" / "4" / "schedstat").write_bytes(b"garbage\n")
    _first("4", monkeypatch)
    assert fs.thread_schedstat(5) == {5: (1000, 7), 6: (2000, 7)}


# --- kept files --------------------------------------------------------------------------------


def test_a_kept_file_is_opened_once_and_re_read_from_its_start(
        fs: ProcFS, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = f"{root}/5/stat"
    opened: list[str] = []
    real_open = os.open

    def counting_open(p: str, flags: int, *args: int) -> int:
        opened.append(p)
        return real_open(p, flags, *args)

    monkeypatch.setattr(procfs.os, "open", counting_open)
    assert fs._read_kept(path) == stat_line(5, utime=300, stime=20, threads=2, start=77, rss=10)
    fd = fs._fds[path]
    assert isinstance(fd, int) and is_open(fd)
    (root / "5" / "stat").write_bytes(stat_line(5, utime=301))  # in place, as procfs answers
    assert fs._read_kept(path) == stat_line(5, utime=301)
    assert fs.stat(5).user_ticks == 301
    assert opened == [path]
    assert fs._fds == {path: fd}


def test_a_kept_file_that_stops_answering_is_closed_and_opened_afresh(
        fs: ProcFS, root: Path) -> None:
    path = f"{root}/5/status"
    before = open_fds()
    assert fs.context_switches(5) == (3, 4)
    old = fs._fds[path]
    (root / "5" / "status").write_bytes(b"")  # an exited process's kept file reads nothing
    with pytest.raises(ProcessGone) as info:
        fs.context_switches(5)
    assert str(info.value) == f"{path}: empty"
    assert path not in fs._fds and not is_open(old)
    assert open_fds() == before
    (root / "5" / "status").write_bytes(b"voluntary_ctxt_switches:\t8\n")  # a new process
    assert fs.context_switches(5) == (8, 0)
    assert path in fs._fds


def test_a_file_that_opens_but_cannot_be_read_is_gone_and_not_kept(
        fs: ProcFS, root: Path) -> None:
    (root / "5" / "stat").unlink()
    (root / "5" / "stat").mkdir()  # open() succeeds, read() fails, as with ESRCH on exit
    before = open_fds()
    with pytest.raises(ProcessGone) as info:
        fs.stat(5)
    assert str(info.value) == f"{root}/5/stat: Is a directory"
    assert fs._fds == {} and open_fds() == before


def test_at_most_max_open_files_are_kept(root: Path) -> None:
    two = ProcFS(root=str(root), max_open=2)
    assert two.stat(5).user_ticks == 300
    assert two.context_switches(5) == (3, 4)
    assert two.thread_user_ticks(5) == {5: 100, 6: 200}  # read, not kept
    assert sorted(two._fds) == [f"{root}/5/stat", f"{root}/5/status"]
    two.close()
    none = ProcFS(root=str(root), max_open=0)
    assert none.stat(5).user_ticks == 300 and none._fds == {}


def test_release_and_close_close_the_descriptors(fs: ProcFS, root: Path) -> None:
    before = open_fds()
    fs.stat(5)
    fs.context_switches(5)
    fs.thread_user_ticks(5)
    fds = dict(fs._fds)
    assert len(fds) == 4 and open_fds() == before + 4
    fs.release(6)  # not a kept process: nothing happens
    assert fs._fds == fds
    fs.release(5)
    assert fs._fds == {} and open_fds() == before
    assert not any(is_open(fd) for fd in fds.values())
    fs.stat(5)
    kept = fs._fds[f"{root}/5/stat"]
    fs.close()
    assert fs._fds == {} and not is_open(kept) and open_fds() == before


@pytest.mark.parametrize(("text", "ok"), [("1", True), ("4194304", True), ("4194305", False),
                                          ("0", False), ("", False),
                                          ("9" * 5000, False), ("²", False)])
def test_is_pid_reads_only_as_many_digits_as_a_pid_has(text: str, ok: bool) -> None:
    """A PID of 5,000 digits (a replay trace's or a pidfile's) is no PID, not a ValueError
    from int()'s digit limit."""
    assert is_pid(text) is ok
