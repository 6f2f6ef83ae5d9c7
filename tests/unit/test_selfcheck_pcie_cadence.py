"""The self-check's PCIe rows at the agent's cadence (1 s, 0.5 s, one long gap) and the
throughput call on its own, on a simulated H200 whose byte counters are 32-bit.

A 32-bit counter wraps every ~80 ms of host->device copies, so a reader that undoes at most
one wrap per read under-reads by far: the row must FAIL then, and PASS only when the agent's
total is right. The agent's backend is also replaced by two hand-written readers of the same
raw counter, one undoing a single wrap per read and one undoing every wrap, so the verdicts
are pinned down whatever the agent does today.
"""

from __future__ import annotations

import io
from typing import Any

import pytest

from mrc_agent.agent.core.hw.base import DeviceSample, GPUIdentity
from mrc_agent.agent.tools.selfcheck import command as selfcheck
from mrc_agent.agent.tools.selfcheck import compare as cmp
from mrc_agent.agent.tools.selfcheck.dry import DryFaults, DryModel, DryWorkload
from mrc_agent.agent.tools.selfcheck.dry_device import DryNvml
from mrc_agent.agent.tools.selfcheck.pcie import counter_check, pcie_cadence_checks

WINDOW_S = 1.2
COUNTER_ROWS = ("pcie.h2d_every_1s.rx_counter", "pcie.h2d_every_0.5s.rx_counter",
                "pcie.h2d_gap_1.2s.rx_counter")


class _Reader:
    """A device source over the model's raw 32-bit RX counter with its own unwrapping."""

    def __init__(self, model: DryModel, every_wrap: bool) -> None:
        self.model, self.every_wrap = model, every_wrap
        self.raw: float | None = None
        self.total = 0.0
        self.true_last = 0.0

    def sample_devices(self) -> list[DeviceSample]:
        true = self.model.pcie_counters(0, self.model.clock())[1]
        raw = true % 2**32
        if self.raw is not None:
            if self.every_wrap:
                self.total += true - self.true_last  # as if every wrap were seen
            else:
                self.total += raw - self.raw if raw >= self.raw else raw + 2**32 - self.raw
        self.raw, self.true_last = raw, true
        return [DeviceSample(GPUIdentity(0, self.model.uuid(0), self.model.name),
                             pcie_rx_bytes_total=self.total)]

    def close(self) -> None:
        pass


def _cadence(model: DryModel, backend: Any = None) -> dict[str, cmp.TruthCheck]:
    make = backend or (lambda: selfcheck.nvml_backend(DryNvml(model), 0.2))
    checks, _ = pcie_cadence_checks(DryWorkload(model), make, lambda: DryNvml(model),
                                    model.uuid(0), WINDOW_S, WINDOW_S, 0.3, 0.3,
                                    lambda _msg: None)
    return {c.name: c for c in checks}


def test_one_wrap_per_read_fails_and_every_wrap_passes() -> None:
    model = DryModel(gpus=1)
    wrong = _cadence(model, lambda: _Reader(model, every_wrap=False))
    right = _cadence(model, lambda: _Reader(model, every_wrap=True))
    for name in COUNTER_ROWS:
        assert wrong[name].verdict == cmp.FAIL, wrong[name]
        ratio = wrong[name].ratio
        assert ratio is not None and ratio < 0.5
        assert right[name].verdict == cmp.PASS, right[name]
        assert right[name].ratio == pytest.approx(1.06, abs=0.03)
        assert right[name].extra["counter_bits"] == 32
    assert "32-bit counter wraps every 0.08" in right[COUNTER_ROWS[0]].note
    assert right["pcie.throughput_call.rx_rate"].verdict == cmp.PASS


def test_the_agents_own_reading_of_a_32_bit_counter_fails_unless_it_is_right() -> None:
    model = DryModel(gpus=1)
    rows = _cadence(model)
    for name in COUNTER_ROWS:
        row = rows[name]
        # What the copies put on the wire between the row's first and last read.
        t0, t1 = row.extra["first_read"], row.extra["last_read"]
        truth = model.pcie_counters(0, t1)[1] - model.pcie_counters(0, t0)[1]
        assert truth > 2**32  # the counter wrapped in every such gap
        right = row.measured is not None and abs(row.measured / truth - 1) < 0.01
        assert (row.verdict == cmp.PASS) == right, row


def test_absent_pcie_counters_on_hopper_fail() -> None:
    model = DryModel(gpus=1, faults=DryFaults(pcie_counters_absent=True))
    rows = _cadence(model)
    for name in COUNTER_ROWS:
        assert rows[name].verdict == cmp.SKIP and rows[name].missing, rows[name]
    required = {c.name: c for c in cmp.require(rows.values(), "this Hopper+ GPU")}
    for name in COUNTER_ROWS:
        assert required[name].verdict == cmp.FAIL
        assert required[name].note.startswith("this Hopper+ GPU has this metric")
    # The throughput call is there without the counters, and is checked on its own.
    assert required["pcie.throughput_call.rx_rate"].verdict == cmp.PASS


def test_a_whole_hopper_run_without_pcie_counters_fails_the_pcie_rows(tmp_path: Any) -> None:
    import json

    model = DryModel(gpus=1, faults=DryFaults(pcie_counters_absent=True))
    plan = selfcheck.Plan.for_mode(True, 1.0)
    code = selfcheck.run_rig(selfcheck.dry_rig(plan, model), plan, tmp_path,
                             stdout=io.StringIO(), stderr=io.StringIO())
    result = json.loads((tmp_path / selfcheck.RESULT_FILE).read_text())
    rows = {c["name"]: c for c in result["checks"]}
    assert code == 1
    for name in ("pcie.h2d.rx_counter", "pcie.d2h.tx_counter"):
        assert rows[name]["verdict"] == cmp.FAIL and "Hopper+" in rows[name]["note"]


def test_counter_check_needs_two_reads() -> None:
    check = counter_check("x", [(0.0, 0.0)], 1e9, 32, 5e10, "why")
    assert check.verdict == cmp.SKIP and check.missing
