"""``mrc-agent diagnose`` on real processes: a Python process spinning in image resizing, an
idle one, a busy one outside image code, a non-Python one; plus the pure parts (collapsed
stacks, top functions, the verdict rules, py-spy's error messages)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mrc_agent.agent.core.hw.procfs import ProcFS
from mrc_agent.agent.tools.diagnose.pyspy import explain_failure, find_py_spy
from mrc_agent.agent.tools.diagnose.sampling import runnable, steal_ratio
from mrc_agent.agent.tools.diagnose.stacks import image_share, parse_collapsed, top_functions
from mrc_agent.agent.tools.diagnose.verdict import Rules, analyse_cpu, decide
from tests.conftest import BUSY, IDLE, REPO, Procs

#: Targets let any process of their user read them (prctl PR_SET_PTRACER_ANY), so py-spy can
#: attach without root under Yama's ptrace_scope=1, where only ancestors may; where Yama is
#: absent the call fails harmlessly with EINVAL.
PTRACER_ANY = "import ctypes\nctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)\n"

#: A preprocessing loop as a service might have it: pure-Python nearest-neighbour resizing of
#: a list-based image, in a function called resize_image in a module called preprocess.
PREPROCESS = PTRACER_ANY + '''
import time


def resize_image(img, width, height):
    src_h, src_w = len(img), len(img[0])
    out = []
    for y in range(height):
        row = img[y * src_h // height]
        new = []
        for x in range(width):
            new.append(row[x * src_w // width])
        out.append(new)
    return out


def main(life):
    img = [[(x * y) % 256 for x in range(96)] for y in range(96)]
    end = time.time() + life
    while time.time() < end:
        resize_image(img, 160, 160)


if __name__ == "__main__":
    main(float(__import__("sys").argv[1]))
'''


def spawn_preprocess(directory: Path, procs: Procs, life: float = 60.0) -> subprocess.Popen[bytes]:
    """The resizing loop as a real process, once its interpreter runs Python code."""
    script = directory / "preprocess.py"
    script.write_text(PREPROCESS)
    p = subprocess.Popen([sys.executable, str(script), str(life)], cwd=directory)
    procs.procs.append(p)
    wait_running(p.pid)
    return p


def wait_running(pid: int) -> None:
    """Until the child has used some CPU: past exec and interpreter start-up."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if int(fields[11]) > 0:  # utime
            time.sleep(0.2)
            return
        time.sleep(0.05)
    raise AssertionError("child never ran")


def starved_trace(directory: Path) -> Path:
    """The synthetic starved GPU: a 0.6 s burst every 3 s, idle in between."""
    out = directory / "starved.jsonl"
    r = subprocess.run([sys.executable, "-m", "mrc_agent.agent.tools.tracegen",
                        "starved", "1", "12"],
                       capture_output=True, text=True, check=True, cwd=REPO)
    out.write_text(r.stdout)
    return out


def mrc(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mrc_agent.agent", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_resizing_process_is_preprocessing_bound(tmp_path: Path, procs: Procs) -> None:
    p = spawn_preprocess(tmp_path, procs)
    trace = starved_trace(tmp_path)
    out = tmp_path / "diag"
    r = mrc("diagnose", "--pid", str(p.pid), "--duration", "3", "--gpu-backend",
            f"replay:{trace}", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "verdict: preprocessing-bound" in r.stdout

    svg = (out / "flamegraph.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "resize_image" in svg
    rep = report(out)
    assert rep["verdict"] == "preprocessing-bound"
    top = rep["top_functions"]["self"][0]
    assert top["function"] == "resize_image" and top["file"].endswith("preprocess.py")
    assert top["self_ratio"] > 0.5
    assert rep["cpu"]["hot"] and rep["gpu"]["available"]
    assert rep["gpu"]["idle_fraction"] >= 0.5
    assert rep["gpu"]["idle_windows"], "the starved trace idles 2.4 s of every 3 s"
    assert any("image code" in e for e in rep["evidence"])
    assert sorted(rep["files"]) == sorted(os.listdir(out))

    # The samples are the agent's own series for this target, over the same window.
    lines = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(lines) >= 10
    names = {s["name"] for line in lines for s in line["samples"]}
    assert {"mrc_process_cpu_user_ratio", "mrc_gpu_utilization_ratio",
            "mrc_gpu_starved"} <= names
    csv_rows = (out / "golden_triangle.csv").read_text().splitlines()
    assert csv_rows[0].startswith("time,elapsed_seconds,pid,cpu_user_ratio")
    assert len(csv_rows) == len(lines) + 1
    stacks = (out / "stacks.txt").read_text()
    # py-spy names the thread when it can read the name from the interpreter, else by id.
    assert "resize_image" in stacks
    assert "MainThread" in stacks or stacks.startswith("thread (")


def test_idle_process_is_not_preprocessing_bound(tmp_path: Path, procs: Procs) -> None:
    p = procs.spawn(PTRACER_ANY + IDLE)
    time.sleep(0.5)
    out = tmp_path / "diag"
    r = mrc("diagnose", "--pid", str(p.pid), "--duration", "2", "--gpu-backend", "none",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = report(out)
    assert rep["verdict"] == "healthy"
    assert not rep["cpu"]["hot"]
    assert not rep["gpu"]["available"] and "no GPU data" in r.stdout
    assert "<svg" in (out / "flamegraph.svg").read_text()  # a placeholder saying "idle"


def test_busy_process_outside_image_code_is_cpu_bound(tmp_path: Path, procs: Procs) -> None:
    p = procs.spawn(PTRACER_ANY + BUSY)
    wait_running(p.pid)
    out = tmp_path / "diag"
    r = mrc("diagnose", "--pid", str(p.pid), "--duration", "2", "--gpu-backend", "none",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = report(out)
    assert rep["cpu"]["hot"]
    assert rep["verdict"] == "cpu-bound"
    assert rep["stacks"]["image_share"] == 0.0


def test_busy_gpu_with_few_instructions_per_byte_is_memory_bound(tmp_path: Path,
                                                                 procs: Procs) -> None:
    p = procs.spawn(PTRACER_ANY + IDLE)
    trace = tmp_path / "busy.jsonl"
    trace.write_text(subprocess.run(
        [sys.executable, "-m", "mrc_agent.agent.tools.tracegen", "busy", "1", "12"],
        capture_output=True, text=True, check=True, cwd=REPO).stdout)
    out = tmp_path / "diag"
    r = mrc("diagnose", "--pid", str(p.pid), "--duration", "2", "--gpu-backend",
            f"replay:{trace}", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = report(out)
    assert rep["verdict"] == "memory-bound"
    assert rep["gpu"]["compute_memory"]["source"] == "cupti_pm_sampling"
    assert rep["gpu"]["compute_memory"]["sm_instructions_per_dram_byte"] < 8


@pytest.mark.parametrize(("args", "message"), [
    (["--pid", "4194303"], "no process with pid 4194303"),
    (["--pid", "999999999"], "PIDs are at most 4194304"),
    (["--pid", "1", "--duration", "0"], "--duration must be"),
    (["--pid", "1", "--interval", "5", "--duration", "2"], "--interval must be"),
    (["--pid", "1", "--gpu-backend", "cuda"], "is not one of auto, nvml, replay:PATH, none"),
    (["--pid", "x"], "invalid int value"),
    ([], "required: --pid"),
])
def test_bad_flags_and_missing_pid_exit_2(args: list[str], message: str) -> None:
    r = mrc("diagnose", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_missing_py_spy_exits_1(tmp_path: Path, procs: Procs) -> None:
    p = procs.spawn(PTRACER_ANY + IDLE)
    r = mrc("diagnose", "--pid", str(p.pid), "--py-spy", str(tmp_path / "py-spy"),
            "--out", str(tmp_path / "d"))
    assert r.returncode == 1
    assert "py-spy not found" in r.stderr


def test_non_python_target_exits_1_and_says_why(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.2)
        r = mrc("diagnose", "--pid", str(sleeper.pid), "--duration", "2", "--gpu-backend",
                "none", "--out", str(tmp_path / "d"))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert r.returncode == 1
    assert "cannot read pid" in r.stderr and "as a Python process" in r.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to drop to another user with setpriv")
def test_no_ptrace_permission_exits_1_and_names_the_capability(tmp_path: Path,
                                                                procs: Procs) -> None:
    # py-spy run as nobody against our process: what a sidecar without CAP_SYS_PTRACE sees.
    bindir = Path(tempfile.mkdtemp(prefix="mrc-pyspy-"))
    try:
        os.chmod(bindir, 0o755)
        shutil.copy(find_py_spy(), bindir / "py-spy-real")
        wrapper = bindir / "py-spy"
        wrapper.write_text("#!/bin/sh\nexec setpriv --reuid 65534 --regid 65534 --clear-groups "
                           f'{bindir / "py-spy-real"} "$@"\n')
        wrapper.chmod(0o755)
        p = spawn_preprocess(tmp_path, procs)
        r = mrc("diagnose", "--pid", str(p.pid), "--duration", "2", "--gpu-backend", "none",
                "--py-spy", str(wrapper), "--out", str(tmp_path / "d"))
    finally:
        shutil.rmtree(bindir)
    assert r.returncode == 1, r.stderr
    assert "permission denied" in r.stderr and "CAP_SYS_PTRACE" in r.stderr


# -- pure parts ------------------------------------------------------------------------------
_MAIN = "thread (101): MainThread;<module> (svc.py:1);serve (svc.py:10)"
RAW = f"""\
{_MAIN};handle (svc.py:20);resize_image (preprocess.py:4) 70
{_MAIN};handle (svc.py:20) 10
{_MAIN};decode (PIL/Image.py:700) 5
thread (202): Thread-1 (loader);run (threading.py:990);load (loader.py:3) 15
"""


def test_collapsed_stacks_and_top_functions() -> None:
    stacks = parse_collapsed(RAW)
    assert [s.thread for s in stacks] == ["MainThread (101)"] * 3 + ["Thread-1 (loader) (202)"]
    main = [s for s in stacks if s.thread == "MainThread (101)"]
    top = top_functions(main)
    assert top["self"][0]["frame"] == "resize_image (preprocess.py:4)"
    assert top["self"][0]["self_samples"] == 70 and top["self"][0]["self_ratio"] == 0.8235
    total = {r["function"]: r["total_samples"] for r in top["total"]}
    assert total["<module>"] == 85 and total["handle"] == 80 and total["decode"] == 5
    share, where = image_share(main)
    assert share == pytest.approx(75 / 85)  # resize_image and PIL's decode, not handle alone
    assert where == [("resize_image (preprocess.py:4)", 70), ("decode (PIL/Image.py:700)", 5)]
    loader = [s for s in stacks if s.thread.startswith("Thread-1")]
    assert image_share(loader)[0] == 0.0


def _gpu(**over: object) -> dict:
    base = {"available": True, "idle_fraction": 0.0, "utilization_mean": 0.9,
            "idle_windows": [], "attributed": True, "starved_fraction": 0.0,
            "pcie_bytes_per_second": 1e9, "nvlink_bytes_per_second": 0.0,
            "sm_active_mean": 0.9,
            "compute_memory": {"source": "none", "sm_instructions_per_dram_byte": None,
                               "gpm_sm_to_dram_activity": None,
                               "dram_bandwidth_utilization": None, "profiling_reason": ""}}
    base.update(over)
    return base


COOL = {"user_ratio_mean": 0.1, "hottest_thread_user_ratio_mean": 0.1, "threshold": 0.9,
        "hot": False}
NO_STACKS = {"busy_thread_samples": 0, "image_share": 0.0, "top_self": []}


def test_transfer_bound_when_links_are_busy_and_the_gpu_waits() -> None:
    v = decide(COOL, _gpu(pcie_bytes_per_second=25e9, utilization_mean=0.3), NO_STACKS)
    assert v.verdict == "transfer-bound"
    v = decide(COOL, _gpu(nvlink_bytes_per_second=300e9, sm_active_mean=0.2), NO_STACKS)
    assert v.verdict == "transfer-bound"
    assert decide(COOL, _gpu(pcie_bytes_per_second=25e9), NO_STACKS).verdict == "healthy"


def test_memory_bound_from_the_gpm_proxy_is_named_as_such() -> None:
    cm = {"source": "gpm_activity_proxy", "sm_instructions_per_dram_byte": None,
          "gpm_sm_to_dram_activity": 1.05, "dram_bandwidth_utilization": 0.85,
          "profiling_reason": "insufficient_permissions"}
    v = decide(COOL, _gpu(compute_memory=cm), NO_STACKS)
    assert v.verdict == "memory-bound" and "GPM activity proxy" in v.summary
    assert any("not an instruction count" in e for e in v.evidence)
    # An idle GPU is not memory-bound, whatever its bursts look like.
    assert decide(COOL, _gpu(compute_memory=cm, idle_fraction=0.9),
                  NO_STACKS).verdict == "healthy"


def test_without_gpu_data_cpu_and_stacks_decide() -> None:
    hot = {**COOL, "user_ratio_mean": 1.0, "hot": True}
    stacks = {"busy_thread_samples": 100, "busy_thread": "MainThread (1)", "image_share": 0.9,
              "top_self": [{"frame": "resize (PIL/Image.py:2200)"}], "image_frames": []}
    v = decide(hot, {"available": False, "reason": "the GPU backend is 'none'"}, stacks)
    assert v.verdict == "preprocessing-bound"
    assert any("no GPU data" in e for e in v.evidence)
    # A busy GPU means the hot CPU is not starving it: not preprocessing-bound.
    assert decide(hot, _gpu(), stacks).verdict == "healthy"
    assert decide(hot, _gpu(idle_fraction=0.8), {**stacks, "image_share": 0.1},
                  Rules()).verdict == "cpu-bound"


def test_py_spy_errors_become_reasons() -> None:
    e = explain_failure(1, "Permission Denied: Try running again with elevated permissions")
    assert e.reason == "permission" and "CAP_SYS_PTRACE" in str(e)
    e = explain_failure(1, "Error: Failed to find python version from target process")
    assert e.reason == "not_python"
    assert explain_failure(1, "Error: something else\nmore").reason == "failed"


def test_cpu_the_hypervisor_stole_counts_as_the_threads(tmp_path: Path) -> None:
    """A thread on a CPU all the window, 15 % of it stolen by the hypervisor: the kernel's
    clocks give it 0.85 s of 1 s and no queueing, under the 0.9 line; the node's steal share
    (from /proc/stat) puts it back at 1.0. Steal is never corrected beyond half the window."""
    (tmp_path / "stat").write_text("cpu  1000 0 100 500 0 0 0 100 0 0\ncpu0 1 2 3 4\n")
    before = ProcFS(root=str(tmp_path)).cpu_ticks()
    (tmp_path / "stat").write_text("cpu  1850 0 100 500 0 0 0 250 0 0\n")
    after = ProcFS(root=str(tmp_path)).cpu_ticks()
    assert before == [1000, 0, 100, 500, 0, 0, 0, 100]
    steal = steal_ratio(before, after)
    assert steal == pytest.approx(0.15)
    sched0, sched1 = {1: (0, 0)}, {1: (850_000_000, 0)}
    plain = runnable(sched0, sched1, 1.0)
    assert plain is not None and not analyse_cpu([], 7, 0.9, plain)["hot"]
    run = runnable(sched0, sched1, 1.0, steal)
    assert run == pytest.approx({"runnable_ratio": 1.0, "on_cpu_ratio": 1.0,
                                 "waiting_ratio": 0.0, "steal_ratio": 0.15})
    cpu = analyse_cpu([], 7, 0.9, run)
    assert cpu["hot"] and cpu["node_steal_ratio"] == 0.15
    half = runnable(sched0, {1: (400_000_000, 0)}, 1.0, 0.8)
    assert half is not None and half["on_cpu_ratio"] == pytest.approx(0.8)
    assert steal_ratio([], after) == 0.0 and steal_ratio(before, before) == 0.0
    assert ProcFS(root=str(tmp_path / "missing")).cpu_ticks() == []


def test_a_thread_waiting_for_a_cpu_still_counts_as_hot() -> None:
    # Thread 1: 0.4 s on a CPU and 0.58 s on the run queue in 1 s; thread 2 born in the window.
    before = {1: (10_000_000_000, 5_000_000_000)}
    after = {1: (10_400_000_000, 5_580_000_000), 2: (100_000_000, 0)}
    run = runnable(before, after, 1.0)
    assert run == pytest.approx({"runnable_ratio": 0.98, "on_cpu_ratio": 0.4,
                                 "waiting_ratio": 0.58, "steal_ratio": 0.0})
    assert runnable(before, {}, 1.0) is None
    assert run is not None
    assert analyse_cpu([], 7, 0.9, run)["hot"]
    assert not analyse_cpu([], 7, 0.9, {**run, "runnable_ratio": 0.5})["hot"]


def test_a_target_that_exits_mid_window_is_inconclusive(tmp_path: Path, procs: Procs) -> None:
    p = procs.spawn(PTRACER_ANY + BUSY, 1.5)  # busy, then gone 1.5 s into a 4 s window
    out = tmp_path / "d"
    r = mrc("diagnose", "--pid", str(p.pid), "--duration", "4", "--gpu-backend", "none",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = report(out)
    assert rep["verdict"] == "inconclusive", rep["summary"]
    assert "exited" in rep["summary"]
