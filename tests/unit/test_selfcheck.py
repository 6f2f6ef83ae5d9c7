"""``mrc-agent selfcheck``: the pure comparisons at their band edges, the whole dry run through
the CLI (table, JSON, trace), a dry device that lies in known ways (the matching checks must
FAIL and only those), the run against the project's own NVML and CUPTI fakes, and the exit
codes for usage errors and a host without CUDA.

The dry runs take real time (the agent's readers run their own threads on the real clock),
about ten seconds each with the shortest ``--duration``.
"""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path
from typing import Any

import pynvml
import pytest

from mrc_agent.agent.cli import main
from mrc_agent.agent.core.hw.base import DeviceSample, GPUIdentity
from mrc_agent.agent.core.hw.cuda_driver import CudaDriver
from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler
from mrc_agent.agent.tools.selfcheck import command as selfcheck
from mrc_agent.agent.tools.selfcheck import compare as cmp
from mrc_agent.agent.tools.selfcheck.dry import DryFaults, DryModel, DryWorkload
from mrc_agent.agent.tools.selfcheck.dry_device import GPM_METRICS, LINKS, DryCupti, DryNvml
from mrc_agent.agent.tools.selfcheck.phases import AgentReaders, timestamp_check
from mrc_agent.agent.tools.selfcheck.workload import WorkDone
from mrc_agent.agent.tools.simgpu.cupti import FakeCupti, FakeDevice
from mrc_agent.agent.tools.simgpu.nvml import FakeNvml, gpu, nvlink

# --- the pure comparisons ----------------------------------------------------------------------


@pytest.mark.parametrize(("measured", "verdict"), [
    (90.0, cmp.PASS), (145.0, cmp.PASS), (100.0, cmp.PASS),
    (89.9, cmp.FAIL), (145.1, cmp.FAIL), (50.0, cmp.FAIL), (-1.0, cmp.FAIL),
    (None, cmp.SKIP),
])
def test_ratio_check_is_inclusive_at_the_band_edges(measured: float | None,
                                                    verdict: str) -> None:
    check = cmp.ratio_check("x", measured, 100.0, cmp.PCIE_COUNTER_BAND, "B")
    assert check.verdict == verdict
    assert check.ratio == (None if measured is None else pytest.approx(measured / 100.0))


def test_ratio_check_without_a_reference_is_not_a_pass() -> None:
    assert cmp.ratio_check("x", 5.0, 0.0, (0.9, 1.1), "B").verdict == cmp.SKIP
    assert cmp.ratio_check("x", 5.0, None, (0.9, 1.1), "B").verdict == cmp.SKIP


def test_direction_check_catches_swapped_tx_and_rx() -> None:
    assert cmp.direction_check("d", wanted=100.0, other=3.0).verdict == cmp.PASS
    assert cmp.direction_check("d", wanted=100.0, other=25.0).verdict == cmp.PASS
    swapped = cmp.direction_check("d", wanted=3.0, other=100.0)
    assert swapped.verdict == cmp.FAIL and "swapped" in swapped.note
    assert cmp.direction_check("d", wanted=0.0, other=0.0).verdict == cmp.FAIL
    assert cmp.direction_check("d", wanted=None, other=1.0).verdict == cmp.SKIP


@pytest.mark.parametrize(("busy", "idle", "duty", "verdict"), [
    (0.95, 0.0, 0.99, cmp.PASS),
    (0.80, 0.05, 0.90, cmp.PASS),  # both thresholds inclusive
    (0.79, 0.0, 0.99, cmp.FAIL),
    (0.95, 0.06, 0.99, cmp.FAIL),
    (0.95, 0.0, 0.5, cmp.SKIP),  # the workload did not keep the GPU busy: no reference
    (None, 0.0, 0.99, cmp.SKIP),
    (0.95, None, 0.99, cmp.SKIP),
])
def test_busy_idle_check(busy: float | None, idle: float | None, duty: float,
                         verdict: str) -> None:
    check = cmp.busy_idle_check("gpm.sm_util", busy, idle, 0.80, 0.05, duty)
    assert check.verdict == verdict


@pytest.mark.parametrize(("single", "double", "verdict"), [
    (1e9, 2e9, cmp.PASS), (1e9, 1.7e9, cmp.PASS), (1e9, 2.3e9, cmp.PASS),
    (1e9, 1.69e9, cmp.FAIL), (1e9, 2.31e9, cmp.FAIL), (1e9, 1e9, cmp.FAIL),
    (0.0, 2e9, cmp.FAIL),  # nothing counted over N GEMMs is a failure, not a skip
    (None, 2e9, cmp.SKIP),
])
def test_doubling_check(single: float | None, double: float | None, verdict: str) -> None:
    assert cmp.doubling_check("d", single, double).verdict == verdict


def test_timestamps_check() -> None:
    start = 100.0
    good = [(100.5, [(99.2, 0.5), (100.4, 1.0)]), (101.0, [(100.9, 1.0)])]
    assert cmp.timestamps_check("t", good, start).verdict == cmp.PASS
    old = cmp.timestamps_check("t", [(100.5, [(98.9, 0.5)])], start)
    assert old.verdict == cmp.FAIL and "older" in old.note
    future = cmp.timestamps_check("t", [(100.5, [(100.6, 0.5)])], start)
    assert future.verdict == cmp.FAIL and "after the call" in future.note
    unordered = cmp.timestamps_check("t", [(100.5, [(100.3, 0.5), (100.1, 0.5)])], start)
    assert unordered.verdict == cmp.FAIL and "order" in unordered.note
    assert cmp.timestamps_check("t", [(100.5, [])], start).verdict == cmp.SKIP


def test_a_sample_stamped_while_the_device_call_ran_is_not_in_the_future() -> None:
    """NVML answers with samples up to the moment it is read, which is after the poll began:
    the check holds them against when the call returned (a busy machine widens the gap)."""
    now = [100.0]

    class SlowDevice:
        def sample_devices(self) -> list[DeviceSample]:
            now[0] += 0.05  # the call takes 50 ms; NVML stamps a sample on the way
            return [DeviceSample(GPUIdentity(0, "GPU-0", "H200"),
                                 util_samples=[(now[0] - 0.01, 1.0)])]

    readers = AgentReaders(SlowDevice(), None, None, gpm_interval=1.0, poll_s=0.1,  # type: ignore[arg-type]
                           clock=lambda: now[0])
    for _ in range(3):
        readers.poll()
    assert all(p.devices_returned == p.t + 0.05 for p in readers.polls)
    check = timestamp_check(readers, "GPU-0", 99.0, after=1)
    assert check.verdict == cmp.PASS, check.note


def test_window_values_median_and_delta() -> None:
    points = [(0.0, 1.0), (1.0, None), (2.0, 5.0), (3.0, 3.0), (4.0, 100.0)]
    assert cmp.window_values(points, 1.0, 3.0) == [5.0, 3.0]
    assert cmp.median([5.0, 3.0]) == 4.0
    assert cmp.median([3.0, float("nan"), 1.0, 2.0]) == 2.0
    assert cmp.median([]) is None
    assert cmp.delta(10.0, 25.0) == 15.0
    assert cmp.delta(None, 25.0) is None


def test_exit_code_and_table() -> None:
    checks = [cmp.ratio_check("a", 1.0, 1.0, (0.9, 1.1), "B"), cmp.skip("b", "why")]
    assert cmp.exit_code(checks) == 0
    checks.append(cmp.ratio_check("c", 2.0, 1.0, (0.9, 1.1), "B/s"))
    assert cmp.exit_code(checks) == 1
    table = cmp.format_table(checks)
    assert table.splitlines()[-1] == "1 PASS, 1 FAIL, 1 SKIP"
    row = next(line for line in table.splitlines() if line.startswith("c "))
    assert "FAIL" in row and "2.00" in row and "0.9-1.1" in row


def test_workdone_rates() -> None:
    work = WorkDone("h2d", 10, 1000, 0.5, 10.0, 11.0)
    assert (work.bytes, work.bandwidth, work.duty) == (10_000, 20_000.0, 0.5)


# --- the dry run -------------------------------------------------------------------------------

def _run_dry(tmp_path: Path, model: DryModel, duration: float = 1.0) -> tuple[int, dict[str, Any]]:
    plan = selfcheck.Plan.for_mode(True, duration)
    code = selfcheck.run_rig(selfcheck.dry_rig(plan, model), plan, tmp_path,
                             stdout=io.StringIO(), stderr=io.StringIO())
    result = json.loads((tmp_path / selfcheck.RESULT_FILE).read_text())
    return code, result


def _verdicts(result: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["verdict"] for c in result["checks"]}


def test_dry_run_through_the_cli_passes_and_writes_table_json_and_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["selfcheck", "--dry", "--out", str(tmp_path), "--duration", "1"])
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "gpu_truth.json").read_text())
    verdicts = _verdicts(result)
    assert code == 0 and result["exit_code"] == 0, out
    assert set(verdicts.values()) == {cmp.PASS}, out
    for name in ("pcie.h2d.rx_counter", "pcie.d2h.tx_counter", "pcie.h2d.gpm_rx_rate",
                 "cupti.dram_read_bytes", "gpm.tensor_util", "cupti.sm_instructions_2x",
                 "nvlink.peer_tx", "nvml.util_samples_time", "cupti.activity_idle_gaps",
                 "trace.record"):
        assert name in verdicts
    table = (tmp_path / "gpu_truth.txt").read_text()
    assert out.startswith(table)
    assert table.splitlines()[-1] == f"{len(verdicts)} PASS, 0 FAIL, 0 SKIP"
    # Host->device lands on the GPU's RX: the ratio is the simulated TLP overhead.
    h2d = next(c for c in result["checks"] if c["name"] == "pcie.h2d.rx_counter")
    assert h2d["ratio"] == pytest.approx(1.06, abs=0.02)
    trace = Path(result["trace"])
    assert trace.name == "dry_h200_trace.jsonl" and trace.parent == tmp_path
    version, *rows = (json.loads(line) for line in trace.read_text().splitlines())
    assert version == {"version": 2} and rows and {r["gpu"] for r in rows} == {0, 1}
    assert any(r.get("sm_instructions_executed_total", 0) > 0 for r in rows)
    # The profiled GPU's hardware timeline is in the trace, every 20 ms.
    stamps = [t for r in rows for t, _ in r.get("activity", ())]
    assert len(stamps) >= 20 and stamps == sorted(stamps)
    assert max(b - a for a, b in zip(stamps, stamps[1:], strict=False)) < 0.05


def test_a_lying_dry_device_fails_exactly_the_checks_it_lies_to(tmp_path: Path) -> None:
    faults = DryFaults(pcie_counter_scale=0.5, dram_read_scale=0.5,
                       gemm_instruction_offset=1e12, util_timestamp_offset_s=3.0,
                       activity_stamp_offset_s=0.1)
    code, result = _run_dry(tmp_path, DryModel(faults=faults))
    verdicts = _verdicts(result)
    failed = {name for name, v in verdicts.items() if v == cmp.FAIL}
    assert code == 1 and result["exit_code"] == 1
    # Where the backend derives its PCIe rates from the same byte counters (the note says
    # so), the halved counters halve those rates too; GPM's PCIe rates are its own.
    notes = {c["name"]: c["note"] for c in result["checks"]}
    from_counters = {name for name in ("pcie.h2d.rx_rate", "pcie.d2h.tx_rate")
                     if "byte_counters" in notes[name]}
    # The PCIe rows at the agent's cadences count the same halved counters.
    cadence = {"pcie.h2d_every_1s.rx_counter", "pcie.h2d_every_0.5s.rx_counter",
               "pcie.h2d_gap_1.5s.rx_counter"}
    assert failed == {"pcie.h2d.rx_counter", "pcie.d2h.tx_counter", "cupti.dram_read_bytes",
                      "cupti.sm_instructions_2x", "nvml.util_samples_time",
                      "cupti.activity_idle_gaps"} | from_counters | cadence, verdicts
    assert "clock mapping is off" in notes["cupti.activity_idle_gaps"]
    assert verdicts["pcie.h2d.gpm_rx_rate"] == verdicts["gpm.sm_util"] == cmp.PASS
    h2d = next(c for c in result["checks"] if c["name"] == "pcie.h2d.rx_counter")
    assert h2d["ratio"] == pytest.approx(0.53, abs=0.02)  # reported whatever the verdict
    assert "FAIL" in (tmp_path / "gpu_truth.txt").read_text()


def test_swapped_pcie_directions_fail_and_one_gpu_skips_nvlink(tmp_path: Path) -> None:
    code, result = _run_dry(tmp_path, DryModel(gpus=1, faults=DryFaults(swap_pcie=True)))
    verdicts = _verdicts(result)
    assert code == 1
    for name in ("pcie.h2d.direction", "pcie.d2h.direction", "pcie.h2d.rx_rate",
                 "pcie.d2h.tx_rate", "pcie.h2d.gpm_rx_rate", "pcie.h2d.rx_counter"):
        assert verdicts[name] == cmp.FAIL, name
    assert verdicts["gpm.sm_util"] == cmp.PASS
    nvlink_row = next(c for c in result["checks"] if c["name"] == "nvlink.peer")
    assert nvlink_row["verdict"] == cmp.SKIP
    assert "unverifiable on one GPU" in nvlink_row["note"]


# --- the same checks against the project's hand-written fakes ------------------------------------

#: Where the bridge's 64-bit PCIe byte counters start.
_WIDE = 2**40


class _Bridge:
    """Moves FakeNvml's and FakeCupti's data on from the dry model before every poll, so
    the project's own fakes report what the dry workload did."""

    def __init__(self, model: DryModel, nvml: FakeNvml, cupti: FakeCupti) -> None:
        self.model, self.nvml, self.cupti = model, nvml, cupti
        self.last = model.clock()
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            m, now = self.model, self.model.clock()
            for i, data in enumerate(self.nvml.gpus):
                tx, rx = m.pcie_rates(i, now - 0.02, now)
                data["pcie"] = {"tx_kb_per_s": int(tx / 1024), "rx_kb_per_s": int(rx / 1024),
                                "replays": 0}
                # Past 2**32 from the first read: a counter typed 64-bit is taken as 32-bit
                # until it shows it is wider, and this one moves only at polls, in jumps a
                # 32-bit counter read between them could not carry.
                ctx, crx = m.pcie_counters(i, now)
                data.setdefault("pcie_count", {})
                data["pcie_count"].update(tx_bytes=int(ctx) + _WIDE, rx_bytes=int(crx) + _WIDE)
                busy = m.busy(i, ("d2d", "gemm"), now - 0.2, now)
                data["util"] = {"gpu": round(100 * busy), "memory": 0}
                data["util_samples"] = m.util_grid(i, 0, now)
                ntx, nrx = m.nvlink_bytes(i, now)
                for link in data["nvlink"].values():
                    link.update(tx_kib=int(ntx / LINKS / 1024), rx_kib=int(nrx / LINKS / 1024))
                values = m.gpm(i, self.last, now)
                data["gpm"] = {int(getattr(pynvml, name)): values[key] * factor
                               for name, (key, factor) in GPM_METRICS.items()}
            self.cupti.devices[0].decodes.append([{
                "sm__inst_executed_realtime.sum": m.instructions(0, now) - m.instructions(0,
                                                                                      self.last),
                "dram__bytes_read.sum": m.dram_read_bytes(0, now) - m.dram_read_bytes(0,
                                                                                   self.last),
            }])
            self.last = now


def test_the_checks_pass_on_the_projects_own_nvml_and_cupti_fakes(tmp_path: Path) -> None:
    model = DryModel(gpus=2)
    fake = FakeNvml([gpu(index=i, uuid=model.uuid(i), name=model.name, gpm={},
                         nvlink={link: nvlink() for link in range(LINKS)})
                     for i in range(2)])
    cupti = FakeCupti({0: FakeDevice(uuid=model.uuid(0))})  # CUDA finds NVML's GPU 0 by UUID
    plan = selfcheck.Plan.for_mode(True, 1.0)
    backend = selfcheck.nvml_backend(fake, plan.gpm_interval)
    sampler = CuptiPmSampler([GPUIdentity(0, model.uuid(0), model.name)], lib=cupti,
                             interval_s=0.1, cuda=CudaDriver(cupti.driver))
    readers = AgentReaders(backend, backend, sampler, plan.gpm_interval, plan.poll_s,
                           before_poll=_Bridge(model, fake, cupti),
                           pcie_settle=plan.pcie_settle_s, util_settle=plan.util_settle_s)
    rig = selfcheck.Rig("dry", DryWorkload(model), readers,
                        lambda: selfcheck._sources(DryNvml(model), DryCupti(model)),
                        backend.info(), [sampler.close, backend.close])
    code = selfcheck.run_rig(rig, plan, tmp_path, stdout=io.StringIO(), stderr=io.StringIO())
    result = json.loads((tmp_path / selfcheck.RESULT_FILE).read_text())
    verdicts = _verdicts(result)
    assert code == 0, verdicts
    for name in ("pcie.h2d.rx_rate", "pcie.d2h.tx_rate", "pcie.h2d.gpm_rx_rate",
                 "cupti.dram_read_bytes", "gpm.dram_bw_util", "gpm.sm_util", "gpm.tensor_util",
                 "nvml.gpu_util", "cupti.sm_instructions_2x", "nvlink.peer_tx",
                 "nvlink.peer_rx", "nvml.util_samples_time"):
        assert verdicts[name] == cmp.PASS, (name, verdicts)


# --- exit codes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["selfcheck"],
    ["selfcheck", "--gpu", "--dry"],
    ["selfcheck", "--dry", "--duration", "abc"],
])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_out_of_range_duration_exits_2(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selfcheck", "--dry", "--duration", "0", "--out", str(tmp_path)]) == 2
    assert "--duration must be" in capsys.readouterr().err


def test_gpu_mode_without_cuda_is_one_line_and_exit_2(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: this is the real check's machine")
    assert main(["selfcheck", "--gpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mrc-agent selfcheck: error: no GPU to check")
    assert not (tmp_path / "gpu_truth.json").exists()
    # An --out it had to create is not left behind, empty.
    assert main(["selfcheck", "--gpu", "--out", str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists()
