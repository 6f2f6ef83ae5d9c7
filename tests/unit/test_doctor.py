"""``doctor``'s profiling check: it tries only the GPUs the agent would profile, tells the pod's
own agent holding the profiler from another profiler, and prints the CUPTI version."""

from __future__ import annotations

import io
from pathlib import Path

from mrc_agent.agent.core.config import AgentConfig
from mrc_agent.agent.core.hw.procfs import ProcFS
from mrc_agent.agent.tools.doctor import agent_pids, cupti_version, run_doctor
from mrc_agent.agent.tools.simgpu.cupti import FakeCupti, FakeDevice, error
from mrc_agent.agent.tools.simgpu.nvml import FakeNvml, gpu
from tests.unit.test_attribution import _proc


def _cupti(devices: dict[int, FakeDevice], **kwargs: object) -> FakeCupti:
    lib = FakeCupti(devices, **kwargs)  # type: ignore[arg-type]
    lib.driver.initialised = True  # a stand-in library gets no cuInit from the sampler
    return lib


def _line(text: str, what: str) -> str:
    return next(line for line in text.splitlines() if f"  {what}  " in line)


def test_the_profiling_check_tries_only_the_targets_gpus(tmp_path: Path) -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    _proc(tmp_path, 4242, environ=b"NVIDIA_VISIBLE_DEVICES=GPU-00000001-fake-uuid\0")
    cupti = _cupti({0: FakeDevice(), 1: FakeDevice()})
    out = io.StringIO()
    cfg = AgentConfig(gpu_backend="nvml", pids=[4242])
    run_doctor(cfg, set(), True, out=out, nvml_lib=fake, cupti_lib=cupti,
               procfs=ProcFS(root=str(tmp_path)))
    assert _line(out.getvalue(), "profiling counters").startswith("ok  ")
    # GPU 0 is the neighbour's: its performance monitors are never touched.
    assert cupti.count(0, "enable") == 0 and cupti.count(1, "enable") == 1


def test_several_gpus_and_no_target_are_not_profiled_unless_the_setting_allows(
    tmp_path: Path,
) -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    cupti = _cupti({0: FakeDevice(), 1: FakeDevice()})
    out = io.StringIO()
    run_doctor(AgentConfig(gpu_backend="nvml"), set(), True, out=out, nvml_lib=fake,
               cupti_lib=cupti, procfs=ProcFS(root=str(tmp_path)))
    assert "attribution_unknown" in _line(out.getvalue(), "profiling counters")
    assert cupti.total("enable") == 0
    out = io.StringIO()
    run_doctor(AgentConfig(gpu_backend="nvml", profile_unattributed=True), set(), True, out=out,
               nvml_lib=fake, cupti_lib=cupti, procfs=ProcFS(root=str(tmp_path)))
    assert cupti.count(0, "enable") == 1 and cupti.count(1, "enable") == 1


def _busy() -> FakeCupti:
    return _cupti({0: FakeDevice(errors={"enable": [error("ERROR_HARDWARE_BUSY")] * 3})})


def test_the_pods_own_agent_holding_the_profiler_is_said_so_not_a_failure(
    tmp_path: Path,
) -> None:
    _proc(tmp_path, 1)
    (tmp_path / "1" / "cmdline").write_bytes(
        b"/usr/bin/python3\0/usr/local/bin/mrc-agent\0run\0--collector\0profiling\0")
    _proc(tmp_path, 7)
    (tmp_path / "7" / "cmdline").write_bytes(b"/usr/local/bin/mrc-agent\0doctor\0")
    procfs = ProcFS(root=str(tmp_path))
    assert agent_pids(procfs) == [1]
    out = io.StringIO()
    code = run_doctor(AgentConfig(gpu_backend="nvml"), {"profiling"}, False, out=out,
                      nvml_lib=FakeNvml([gpu(index=0)]), cupti_lib=_busy(), procfs=procfs)
    line = _line(out.getvalue(), "profiling counters")
    assert line.startswith("info") and "held by this pod's agent (PID 1" in line
    assert code == 0, out.getvalue()


def test_busy_without_the_agent_beside_doctor_stays_a_failure(tmp_path: Path) -> None:
    _proc(tmp_path, 1)
    (tmp_path / "1" / "cmdline").write_bytes(b"python3\0-m\0vllm.entrypoints.openai\0")
    out = io.StringIO()
    code = run_doctor(AgentConfig(gpu_backend="nvml"), {"profiling"}, False, out=out,
                      nvml_lib=FakeNvml([gpu(index=0)]), cupti_lib=_busy(),
                      procfs=ProcFS(root=str(tmp_path)))
    assert _line(out.getvalue(), "profiling counters").startswith("FAIL  ")
    assert "profiler_busy" in out.getvalue() and code == 1


def test_doctor_prints_the_cupti_version(tmp_path: Path) -> None:
    out = io.StringIO()
    run_doctor(AgentConfig(gpu_backend="nvml"), set(), True, out=out,
               nvml_lib=FakeNvml([gpu(index=0)]), cupti_lib=_cupti({0: FakeDevice()},
                                                                     version="cupti-python 9.9"),
               procfs=ProcFS(root=str(tmp_path)))
    assert _line(out.getvalue(), "CUPTI").endswith("cupti-python 9.9")
    # The real library: the installed packages' versions, or that they are not installed.
    assert "cupti-python" in cupti_version(None)
