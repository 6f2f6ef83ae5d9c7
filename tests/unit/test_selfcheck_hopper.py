"""``mrc-agent selfcheck`` on Hopper or newer: a metric the part has is a FAIL, never a SKIP,
when the agent reports nothing for it, and the run exits 1.

Two dry runs on the simulated H200 whose PM sampling refuses to enable (no profiling
permission): as compute capability 9.0 the CUPTI rows FAIL; as 8.0 (Ampere) the same rows are
SKIPs and the run passes. 64-bit PCIe counters keep the PCIe rows out of it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from mrc_agent.agent.tools.selfcheck import command as selfcheck
from mrc_agent.agent.tools.selfcheck import compare as cmp
from mrc_agent.agent.tools.selfcheck.dry import DryFaults, DryModel

CUPTI_ROWS = ("cupti.dram_read_bytes", "cupti.sm_instructions_2x", "cupti.sampler_process")


def _run(tmp_path: Path, model: DryModel) -> tuple[int, dict[str, Any]]:
    plan = selfcheck.Plan.for_mode(True, 1.0)
    code = selfcheck.run_rig(selfcheck.dry_rig(plan, model), plan, tmp_path,
                             stdout=io.StringIO(), stderr=io.StringIO())
    return code, json.loads((tmp_path / selfcheck.RESULT_FILE).read_text())


def test_hopper_where_cupti_never_starts_fails_and_exits_1(tmp_path: Path) -> None:
    model = DryModel(faults=DryFaults(cupti_refused=True), pcie_counter_bits=64)
    code, result = _run(tmp_path, model)
    rows = {c["name"]: c for c in result["checks"]}
    assert result["device"]["part"]["hopper_or_newer"] is True
    for name in CUPTI_ROWS:
        assert rows[name]["verdict"] == cmp.FAIL, rows[name]
        assert "Hopper+" in rows[name]["note"], rows[name]["note"]
    assert "never started" in rows["cupti.sampler_process"]["note"]
    assert "no_permission" in rows["cupti.sampler_process"]["note"]
    assert code == 1 and result["exit_code"] == 1
    # NVLink needs a second GPU: never required; here it has one and passes anyway.
    assert rows["nvlink.peer_tx"]["verdict"] == cmp.PASS


def test_the_same_run_before_hopper_only_skips(tmp_path: Path) -> None:
    model = DryModel(faults=DryFaults(cupti_refused=True), pcie_counter_bits=64,
                     compute_capability=(8, 0))
    code, result = _run(tmp_path, model)
    rows = {c["name"]: c for c in result["checks"]}
    assert result["device"]["part"] == {"compute_capability": [8, 0], "architecture": "AMPERE",
                                        "hopper_or_newer": False}
    for name in CUPTI_ROWS:
        assert rows[name]["verdict"] == cmp.SKIP and rows[name]["missing"], rows[name]
    assert code == 0, {n: c["verdict"] for n, c in rows.items()}


def test_hopper_is_read_from_the_capability_else_from_nvml() -> None:
    assert cmp.hopper_or_newer((9, 0), None) and cmp.hopper_or_newer((10, 0), "AMPERE")
    assert not cmp.hopper_or_newer((8, 9), "HOPPER")  # CUDA's answer wins
    assert cmp.hopper_or_newer(None, "BLACKWELL")
    assert not cmp.hopper_or_newer(None, "DLA") and not cmp.hopper_or_newer(None, None)


def test_require_turns_only_missing_skips_into_fails() -> None:
    checks = [cmp.ratio_check("pcie.h2d.rx_counter", None, 1.0, (0.9, 1.1), "B"),
              cmp.ratio_check("gpm.x", 1.0, 0.0, (0.9, 1.1), "B"),  # no reference: stays
              cmp.ratio_check("nvlink.peer_tx", None, 1.0, (0.9, 1.1), "B")]
    out = cmp.require(checks, "this Hopper+ GPU")
    assert [c.verdict for c in out] == [cmp.FAIL, cmp.SKIP, cmp.SKIP]
    assert cmp.exit_code(out) == 1
