"""Choosing the PM-sampling metrics from a chip's single-pass sets (pure functions)."""

from __future__ import annotations

import pytest

from mrc_agent.agent.core.hw.cupti_metrics import (
    DRAM_READ_METRICS,
    DRAM_THROUGHPUT_METRICS,
    SM_INSTRUCTION_METRICS,
    MetricChoice,
    best_offered,
    choose_from_sets,
    fallback_choices,
    query_sets,
)
from tests.fakes.fake_cupti import FakeCupti, FakeDevice, cuptiError

PCT = "dramc__read_throughput.avg.pct_of_peak_sustained_elapsed"


@pytest.mark.parametrize(
    "listed",
    [
        ["dram__bytes_read"],  # a base name without rollup
        ["dram__bytes_read.sum"],  # the full name wanted
        ["dram__bytes_read.max.per_second"],  # another rollup of the same base
    ],
)
def test_names_match_by_base_name_and_keep_the_wanted_rollup(listed: list[str]) -> None:
    assert best_offered(listed, DRAM_READ_METRICS) == "dram__bytes_read.sum"


def test_a_base_name_that_merely_starts_alike_does_not_match() -> None:
    assert best_offered(["dram__bytes_read_ecc.sum", "dram__bytes"], DRAM_READ_METRICS) is None


def test_the_pair_comes_from_one_set_even_when_another_set_has_a_better_single_name() -> None:
    sets = [
        ("Sm", ["sm__inst_executed_realtime.sum"]),
        ("Dram", ["dram__bytes_read.sum"]),
        ("Both", ["sm__inst_executed.sum", "dram__bytes_op_read.sum"]),
    ]
    assert choose_from_sets(sets) == MetricChoice(
        "sm__inst_executed.sum", "dram__bytes_op_read.sum", "Both")


def test_a_byte_counter_pair_beats_a_throughput_pair() -> None:
    sets = [
        ("Pct", ["sm__inst_executed_realtime", PCT]),
        ("Bytes", ["sm__inst_executed", "dramc__bytes_read"]),
    ]
    choice = choose_from_sets(sets)
    assert choice == MetricChoice("sm__inst_executed.sum", "dramc__bytes_read.sum", "Bytes")
    assert not choice.dram_is_ratio


def test_a_set_with_only_the_throughput_percentage_gives_a_ratio_pair() -> None:
    choice = choose_from_sets([("Hopper", ["sm__inst_executed_realtime", "dramc__read_throughput",
                                           "gr__cycles_elapsed"])])
    assert choice == MetricChoice(SM_INSTRUCTION_METRICS[0], PCT, "Hopper")
    assert choice.dram_is_ratio
    assert choice.metrics == [SM_INSTRUCTION_METRICS[0], PCT]


def test_without_any_pair_the_best_single_metric_is_chosen() -> None:
    sets = [("Pct", [PCT]), ("Bytes", ["dram__bytes_read"]), ("Sm", ["sm__inst_executed"])]
    assert choose_from_sets(sets) == MetricChoice("sm__inst_executed.sum", None, "Sm")
    assert choose_from_sets(sets[:2]) == MetricChoice(None, "dram__bytes_read.sum", "Bytes")


def test_between_equal_sets_the_first_listed_wins_and_nothing_offered_is_none() -> None:
    both = ["sm__inst_executed_realtime", "dram__bytes_read"]
    assert choose_from_sets([("A", both), ("B", both)]) == MetricChoice(
        SM_INSTRUCTION_METRICS[0], DRAM_READ_METRICS[0], "A")
    assert choose_from_sets([("Other", ["gr__cycles_elapsed.max"])]) is None
    assert choose_from_sets([]) is None


def test_fallback_tries_every_pair_before_any_single_metric_and_bytes_before_throughput() -> None:
    choices = fallback_choices()
    assert choices[0] == MetricChoice(SM_INSTRUCTION_METRICS[0], DRAM_READ_METRICS[0])
    kinds = [(c.sm_metric is not None, c.dram_metric is not None, c.dram_is_ratio)
             for c in choices]
    first_single = kinds.index((True, False, False))
    assert all(sm and dram for sm, dram, _ in kinds[:first_single])
    first_ratio_pair = next(i for i, c in enumerate(choices) if c.dram_is_ratio)
    assert all(not c.dram_is_ratio for c in choices[:first_ratio_pair])
    assert {c.dram_metric for c in choices} >= set(DRAM_READ_METRICS + DRAM_THROUGHPUT_METRICS)
    assert all(c.metric_set is None for c in choices)


def test_query_sets_reads_the_chips_sets_and_says_none_where_the_api_cannot_answer() -> None:
    errors = (cuptiError, ValueError, RuntimeError)
    lib = FakeCupti({0: FakeDevice(chip_name="GH100", single_pass_sets={"S0": ["a", "b"]})})
    assert query_sets(lib, "GH100", errors) == [("S0", ["a", "b"])]
    assert query_sets(lib, "GB999", errors) is None  # ValueError: unsupported chip
    assert query_sets(FakeCupti({0: FakeDevice()}, set_api=False), "GH100", errors) is None
