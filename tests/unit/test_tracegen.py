"""tracegen: synthetic traces recorded from the one simulated GPU through the agent's adapters.

What a trace says must be what the pattern made the simulated GPU do, read back in the
project's units (NVML's KB/s and KiB truncate, nothing else may differ); what the simulated GPU
lacks must be absent; and the demo's embedded trace must still be ``tracegen starved 1 12``.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mrc_agent.agent.core.hw.replay import FORMAT_VERSION, ReplayBackend, load_trace
from mrc_agent.agent.tools.tracegen import (
    H200_NVLINK_LINKS,
    activity,
    write_trace,
)
from tests.conftest import REPO

EMBEDDED = REPO / "agent" / "tools" / "data" / "demo_starved.jsonl"


def rows(**kwargs: Any) -> list[dict[str, Any]]:
    out = io.StringIO()
    n = write_trace(out, **kwargs)
    header, *lines = (json.loads(line) for line in out.getvalue().splitlines())
    assert header == {"version": FORMAT_VERSION} and len(lines) == n
    return lines


def test_the_embedded_demo_trace_is_tracegen_starved_1_12() -> None:
    fresh = subprocess.run([sys.executable, "-m", "mrc_agent.agent.tools.tracegen", "starved",
                            "1", "12"], capture_output=True, text=True, check=True, cwd=REPO)
    assert fresh.stdout == EMBEDDED.read_text(), (
        "agent/tools/data/demo_starved.jsonl is stale: regenerate it with "
        "`python -m mrc_agent.agent.tools.tracegen starved 1 12 > "
        "agent/tools/data/demo_starved.jsonl`")


def test_a_trace_has_duration_over_step_samples_per_gpu_and_loads() -> None:
    got = rows(gpus=2, duration=3.0, step=0.1, pattern="busy")
    assert len(got) == 2 * 30
    assert [r["t"] for r in got[::2]] == [round(k * 0.1, 4) for k in range(30)]
    assert {r["uuid"] for r in got} == {"GPU-synthetic-0000", "GPU-synthetic-0001"}


@pytest.mark.parametrize("pattern", ["starved", "busy", "low_nvlink"])
def test_what_the_adapters_read_is_what_the_pattern_did(pattern: str, tmp_path: Path) -> None:
    step = 0.1
    got = rows(gpus=1, duration=6.0, step=step, pattern=pattern)
    for r in got:
        a = activity(pattern, r["t"], 0)
        assert r["gpu_util"] == pytest.approx(round(100 * a["gpu_util"]) / 100)
        assert r["mem_util"] == pytest.approx(round(100 * a["dram_bw_util"]) / 100)
        assert r["mem_used_bytes"] == a["mem_used_bytes"]
        assert r["power_watts"] == pytest.approx(a["power_watts"])
        if r["t"] > 0:
            # PCIe: the PCIe thread's round at this moment, in whole KB/s.
            assert r["pcie_rx_bytes_per_second"] == pytest.approx(
                a["pcie_rx_bytes_per_second"], abs=1024)
    # Counters integrate the rates: SM instructions over whole sampling intervals, NVLink in
    # whole KiB per link.
    inst = sum(activity(pattern, k * step, 0)["instructions_rate"] * step for k in range(59))
    assert got[-1]["sm_instructions_executed_total"] == pytest.approx(inst, rel=1e-9)
    nvlink = sum(activity(pattern, k * step, 0)["nvlink_tx_rate"] * step for k in range(59))
    assert nvlink - H200_NVLINK_LINKS * 1024 <= got[-1]["nvlink_tx_bytes_total"] <= nvlink
    # GPM is a window between two samples, taken at most every 0.2 s (every other row here;
    # the row between repeats it): the mean of that window's two steps.
    gpm = [r for r in got if "sm_util" in r]
    assert gpm and gpm[0]["t"] == pytest.approx(0.2)
    for r in gpm:
        end = round(r["t"] / step) // 2 * 2
        steps = [activity(pattern, k * step, 0) for k in (end - 2, end - 1)]
        assert r["sm_util"] == pytest.approx(sum(s["sm_util"] for s in steps) / 2, abs=1e-6)
    # The hardware activity timeline: a point per PM-sampling interval (the step here), dated
    # by the interval's end, holding the share of it the GPU was busy.
    points = [p for r in got for p in r.get("activity", ())]
    assert [t for t, _ in points] == [round(k * step, 4) for k in range(1, 60)]
    for t, share in points:
        assert share == pytest.approx(activity(pattern, t - step, 0)["gpu_util"], abs=1e-4)
    assert {r["activity_metric"] for r in got} == {
        "gr__cycles_active.avg.pct_of_peak_sustained_elapsed"}
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{"version": {FORMAT_VERSION}}}\n'
                    + "".join(json.dumps(r) + "\n" for r in got))
    assert load_trace(str(path))  # the replay validator takes it as it is


def test_what_the_simulated_gpu_lacks_is_absent() -> None:
    got = rows(gpus=1, duration=1.0, pattern="busy")
    absent = {"sm_clock_hertz", "temperature_celsius", "ecc_corrected_total",
              "pcie_replays_total", "xid_errors_total"}
    assert not absent & set().union(*got)


def test_the_starved_pattern_replays_idle_windows_between_bursts() -> None:
    now = [0.0]
    path = REPO / "agent" / "tools" / "data" / "demo_starved.jsonl"
    backend = ReplayBackend(str(path), clock=lambda: now[0])
    seen = []
    for k in range(30):
        now[0] = k * 0.1
        seen.append(backend.sample_devices()[0].gpu_util)
    assert seen[:6] == [0.97] * 6 and seen[6:30] == [0.0] * 24


def test_mig_rows_carry_their_instance_and_no_profiling() -> None:
    got = rows(gpus=1, duration=1.0, step=0.5, mig=3, pattern="busy")
    migs = [r for r in got if r["uuid"].startswith("MIG-")]
    assert len(migs) == 2 * 3
    assert {r["gpu_instance"] for r in migs if "sm_util" in r} == {1, 2, 3}
    assert all(r["mem_used_bytes"] <= r["mem_total_bytes"] for r in migs)
    assert not [r for r in got if "sm_instructions_executed_total" in r or "gpu_util" in r]


@pytest.mark.parametrize("kwargs", [{"pattern": "nope"}, {"mig": 8}, {"step": 0.0},
                                    {"duration": 0.05, "step": 0.1}])
def test_bad_arguments_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        write_trace(io.StringIO(), **kwargs)
