"""Choosing the PM-sampling metrics from a chip's single-pass sets (pure functions)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

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
from mrc_agent.agent.tools.simgpu.cupti import FakeCupti, FakeDevice, cuptiError

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


def test_within_pairs_of_a_kind_the_more_preferred_names_win_whatever_the_order() -> None:
    worse_sm = ("A", ["sm__inst_executed", "dram__bytes_read"])
    better_sm = ("B", ["sm__inst_executed_realtime", "dram__bytes_read"])
    best = MetricChoice(SM_INSTRUCTION_METRICS[0], DRAM_READ_METRICS[0], "B")
    assert choose_from_sets([worse_sm, better_sm]) == best
    worse_dram = ("C", ["sm__inst_executed_realtime", "dram__bytes_op_read"])
    assert choose_from_sets([worse_dram, better_sm]) == best


def test_a_throughput_pair_beats_a_better_sm_name_alone() -> None:
    sets = [("Sm", ["sm__inst_executed_realtime"]), ("Pct", ["sm__inst_executed", PCT])]
    assert choose_from_sets(sets) == MetricChoice("sm__inst_executed.sum", PCT, "Pct")


def test_dram_bytes_alone_beat_throughput_alone() -> None:
    sets = [("Pct", [PCT]), ("Bytes", ["dram__bytes_op_read"])]
    assert choose_from_sets(sets) == MetricChoice(None, "dram__bytes_op_read.sum", "Bytes")


def test_a_set_offering_nothing_is_skipped_not_the_end_of_the_search() -> None:
    sets = [("Other", ["gr__cycles_elapsed.max"]), ("Sm", ["sm__inst_executed"])]
    assert choose_from_sets(sets) == MetricChoice("sm__inst_executed.sum", None, "Sm")


def test_describe_names_the_metrics_and_the_set_or_its_absence() -> None:
    assert MetricChoice("a.sum", None).describe() == "metrics a.sum, None (no single-pass set)"
    assert MetricChoice("a.sum", "b.sum", "S1").describe() == "metrics a.sum, b.sum (set S1)"


def test_query_sets_is_none_without_profiler_host_or_with_half_the_set_api() -> None:
    errors = (cuptiError, ValueError, RuntimeError)
    assert query_sets(SimpleNamespace(), "GH100", errors) is None
    half = SimpleNamespace(profiler_host=SimpleNamespace(get_single_pass_sets=lambda chip: ["S"]))
    assert query_sets(half, "GH100", errors) is None


def test_a_failing_set_query_is_logged_with_the_chip_and_the_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lib = FakeCupti({0: FakeDevice(chip_name="GH100")})

    with caplog.at_level(logging.INFO, logger="mrc_agent.agent.core.hw.cupti_metrics"):
        assert query_sets(lib, "GB999", (ValueError,)) is None

    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith("CUPTI single-pass metric sets of GB999 unavailable (ValueError: ")
    assert 'Unsupported chip_name "GB999"' in message
    assert message.endswith("); trying metric names in order")
