"""The GPU side end to end without a GPU: fake NVML / fake CUPTI at the hardware boundary,
real collectors, runner, record and doctor above it."""

from __future__ import annotations

import io
import json

import pynvml

from mrc_agent.agent.core.config import AgentConfig
from mrc_agent.agent.core.hw.nvml import NvmlBackend
from mrc_agent.agent.core.hw.replay import ReplayBackend, load_trace
from mrc_agent.agent.core.hw.sources import Sources
from mrc_agent.agent.core.runner import Runner
from mrc_agent.agent.core.targets import TargetResolver
from mrc_agent.agent.core.wiring import build_collectors
from mrc_agent.agent.tools.doctor import run_doctor
from mrc_agent.agent.tools.record import record
from mrc_agent.agent.tools.simgpu.cupti import FakeCupti, FakeDevice
from mrc_agent.agent.tools.simgpu.nvml import FakeNvml, gpu, nvlink
from mrc_agent.exporters.exposition.snapshot import HistogramValue
from tests.conftest import DATA


def _runner(nvml: NvmlBackend, names=("gpu", "gpm", "derived")) -> Runner:
    cfg = AgentConfig()
    src = Sources(device=nvml, gpm=nvml)
    return Runner(build_collectors(cfg, src, names), TargetResolver(), 1.0)


def _values(snap, name: str) -> list[float]:
    return [v for n, _, v in snap.samples if n == name]


def _health(snap, collector: str) -> float:
    return next(v for n, labels, v in snap.samples
                if n == "mrc_agent_collector_success" and labels == (collector,))


def test_nvml_failure_at_runtime_is_isolated_and_recovers() -> None:
    fake = FakeNvml([gpu(index=0, nvlink={0: nvlink(1024, 2048), 1: nvlink(1024, 0)})])
    runner = _runner(NvmlBackend(lib=fake, pcie_thread=False))
    snap = runner.sample_once()
    assert _health(snap, "gpu") == 1.0
    assert _values(snap, "mrc_gpu_nvlink_tx_bytes_total") == [2048 * 1024.0]
    assert _values(snap, "mrc_gpu_nvlink_link_rx_bytes_total") == [2048 * 1024.0, 0.0]
    fake.lose_gpu(0)
    snap = runner.sample_once()
    assert _health(snap, "gpu") == 0.0 and _health(snap, "derived") == 1.0
    assert not _values(snap, "mrc_gpu_utilization_ratio")
    fake.restore_gpu(0)
    snap = runner.sample_once()
    assert _health(snap, "gpu") == 1.0
    assert _values(snap, "mrc_gpu_utilization_ratio") == [0.5]


def test_no_nvml_library_means_unavailable_collectors_not_a_crash() -> None:
    runner = _runner(NvmlBackend(lib=FakeNvml([], library_missing=True), pcie_thread=False))
    for _ in range(3):
        snap = runner.sample_once()
    avail = {labels[0]: v for n, labels, v in snap.samples
             if n == "mrc_agent_collector_available"}
    assert avail == {"gpu": 0.0, "gpm": 0.0, "derived": 1.0}


def test_record_writes_a_trace_that_replays(tmp_path) -> None:
    clock = [0.0]
    src = ReplayBackend(str(DATA / "fixed_device.jsonl"), clock=lambda: clock[0])

    def sleep(seconds: float) -> None:
        clock[0] += max(seconds, 0.05)

    out = io.StringIO()
    lines = record(Sources(src, src, src), out, duration=1.0, interval=0.25,
                   clock=lambda: clock[0], sleep=sleep)
    assert lines == 10  # 5 ticks x 2 GPUs
    path = tmp_path / "rec.jsonl"
    path.write_text(out.getvalue())
    gpus = load_trace(str(path))  # validates: counters monotonic, ratios in range
    assert [g.identity.index for g in gpus.values()] == [0, 1]  # keyed by UUID
    version, first = map(json.loads, out.getvalue().splitlines()[:2])
    assert version == {"version": 2}  # the format's version comes first
    assert first["uuid"] == "GPU-fixed-0000" and "sm_instructions_executed_total" in first
    assert "dram_bw_util" in first and "nvlink_tx_bytes_total" in first


def test_doctor_reports_and_fails_only_for_requested_collectors() -> None:
    fake = FakeNvml([gpu(index=0, gpm={pynvml.NVML_GPM_METRIC_SM_UTIL: 1.0})])
    cupti = FakeCupti({0: FakeDevice(errors={"enable": [PermissionError("admin only")] * 9})})
    out = io.StringIO()
    cfg = AgentConfig(gpu_backend="nvml")
    code = run_doctor(cfg, explicit_collectors=set(), explicit_backend=True, out=out,
                      nvml_lib=fake, cupti_lib=cupti)
    text = out.getvalue()
    assert code == 0, text
    assert "driver 550.54.15" in text and "NVIDIA H100" in text
    assert "no_permission" in text
    out = io.StringIO()
    code = run_doctor(cfg, explicit_collectors={"profiling"}, explicit_backend=True, out=out,
                      nvml_lib=fake, cupti_lib=cupti)
    assert code == 1 and "cannot run: profiling" in out.getvalue()


def test_doctor_without_nvml_fails_only_when_nvml_was_asked_for() -> None:
    missing = FakeNvml([], library_missing=True)
    out = io.StringIO()
    assert run_doctor(AgentConfig(), set(), False, out=out, nvml_lib=missing) == 0
    assert "FAIL  NVML" in out.getvalue()
    assert run_doctor(AgentConfig(gpu_backend="nvml"), set(), True, out=io.StringIO(),
                      nvml_lib=missing) == 1


REASONS = {"nvml_missing", "driver_not_loaded", "no_gpu", "no_permission", "cupti_missing",
           "cuda_missing", "profiler_busy", "unsupported_device", "gpm_unsupported"}


def test_real_libraries_on_this_host_answer_or_say_why() -> None:
    """The real pynvml and cupti modules, not fakes: on a host without a GPU they must map to
    a bounded reason; on a GPU host they must sample."""
    from mrc_agent.agent.core.hw.base import GPUIdentity, SourceUnavailable
    from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler

    nvml = NvmlBackend(pcie_thread=False)
    gpu = GPUIdentity(0, "GPU-0", "any")
    try:
        samples = nvml.sample_devices()
        assert samples and all(s.gpu.uuid for s in samples)
        gpu = samples[0].gpu  # CUPTI finds its CUDA device by the UUID NVML reports
    except SourceUnavailable as exc:
        assert exc.reason in REASONS, exc
    finally:
        nvml.close()
    sampler = CuptiPmSampler([gpu])
    try:
        sampler.sample_profiling()
        assert sampler.status()[0] == "ok"
    except SourceUnavailable as exc:
        assert exc.reason in REASONS, exc
        assert sampler.status()[0] == exc.reason
    finally:
        sampler.close()


def test_a_replayed_activity_timeline_feeds_idle_windows_nvml_rows_cannot_show(
        tmp_path) -> None:
    # NVML's rows every 0.1 s say busy throughout; the 20 ms hardware timeline holds one
    # 60 ms idle window per second. Replayed through the collectors, the windows are counted.
    rows: list[dict[str, object]] = []
    for k in range(20):
        t = round(k * 0.1, 4)
        pts = [[round(t + j * 0.02, 4), 0.0 if 0.5 <= (t + j * 0.02) % 1.0 < 0.56 else 1.0]
               for j in range(1, 6)]
        rows.append({"t": t, "gpu": 0, "gpu_util": 1.0, "activity": pts,
                     "activity_metric": "gr__cycles_active.avg.pct_of_peak_sustained_elapsed"})
    path = tmp_path / "v2.jsonl"
    path.write_text('{"version": 2}\n' + "".join(json.dumps(r) + "\n" for r in rows))
    now = [50.0]
    src = ReplayBackend(str(path), clock=lambda: now[0])
    runner = Runner(build_collectors(AgentConfig(), Sources(src, None, src),
                                     ("gpu", "profiling", "derived")),
                    TargetResolver(), 1.0, clock=lambda: now[0])
    for _ in range(12):  # three seconds: over one loop of the two-second trace
        now[0] += 0.25
        snap = runner.sample_once()
    (hist,) = [v for n, _, v in snap.samples if n == "mrc_gpu_idle_window_seconds"]
    assert isinstance(hist, HistogramValue)
    assert hist.total == 3  # at 0.5, 1.5 and (the next loop) 2.5 s
    assert 0.04 <= hist.sum / hist.total <= 0.08
    busy = _values(snap, "mrc_gpu_busy_seconds_total")
    assert busy and 2.5 < busy[0] < 3.0
