"""The profiling source against the PM-sampling sets real chips offer (tests/data/cupti_sets,
read out of libcupti.so.13 13.4.92 and 13.5.25): what it configures, in what unit it counts
DRAM reads, and what the collector then says."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mrc_agent.agent.core.collectors import profiling
from mrc_agent.agent.core.collectors.base import PassView
from mrc_agent.agent.core.collectors.gpm import GpmReadings
from mrc_agent.agent.core.collectors.profiling import (
    PROFILING_METRICS_INFO,
    ProfilingCollector,
    ProfilingStatus,
    compute_memory_source,
)
from mrc_agent.agent.core.hw.base import GPUIdentity, ProfilingSample
from mrc_agent.agent.core.hw.cuda_driver import CudaDriver
from mrc_agent.agent.core.hw.cupti_metrics import (
    BASIS_CUPTI,
    BASIS_NAME,
    SECTOR_BYTES,
    MetricChoice,
    choose_from_sets,
    ordered_choices,
    split_name,
    with_unit,
)
from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler
from mrc_agent.agent.tools.simgpu.cupti import FakeCupti, FakeDevice, fake_uuid
from tests.cupti_support import real_device, real_sets
from tests.support import pass_view, run_pass

VERSIONS = ("13.4.92", "13.5.25")
SM = "sm__inst_executed_realtime.sum"
GH100_SECTORS = "dramc__sectors_op_read.sum"
GH100_PCT = "Compute_Triage.dramc__read_throughput.avg.pct_of_peak_sustained_elapsed"
GH100_ACTIVE = "gr__cycles_active.avg.pct_of_peak_sustained_elapsed"


def sets_of(version: str, chip: str) -> list[tuple[str, Sequence[str]]]:
    return [(entry["set"], entry["metrics"]) for entry in real_sets(version, chip)]


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("Compute_Triage.dramc__read_throughput",
         ("Compute_Triage.", "dramc__read_throughput", "")),
        ("Compute_Triage.dramc__read_throughput.avg.pct_of_peak_sustained_elapsed",
         ("Compute_Triage.", "dramc__read_throughput", ".avg.pct_of_peak_sustained_elapsed")),
        ("TPC.Compute_Triage.sm__inst_executed_pipe_fma_realtime.sum",
         ("TPC.Compute_Triage.", "sm__inst_executed_pipe_fma_realtime", ".sum")),
        ("dram__bytes_read.sum", ("", "dram__bytes_read", ".sum")),
        ("gr__cycles", ("", "gr__cycles", "")),
        ("nodunder", ("", "nodunder", "")),
    ],
)
def test_names_split_on_their_double_underscore_token(name: str, parts: tuple) -> None:
    assert split_name(name) == parts


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("chip", "expected"),
    [
        # H100/H200: the only set; DRAM reads are 32-byte sectors.
        ("gh100", MetricChoice(SM, GH100_SECTORS, "Compute_Triage")),
        ("gb100", MetricChoice(SM, "dram__sectors_read.sum", "Compute_Triage")),
        ("gr100", MetricChoice(SM, "dram__sectors_op_read.sum", "TriageCompute")),
        # GB20x: the first set listed that offers the pair.
        ("gb202", MetricChoice(SM, "dram__sectors_op_read.sum", None)),
        # Jetson-class GB20B: no set offers DRAM reads at all.
        ("gb20b", MetricChoice(SM, None, None)),
    ],
)
def test_the_chip_sets_give_an_sm_and_dram_pair_wherever_one_exists(
    version: str, chip: str, expected: MetricChoice,
) -> None:
    sets = sets_of(version, chip)
    choice = choose_from_sets(sets)

    assert choice is not None
    assert (choice.sm_metric, choice.dram_metric) == (expected.sm_metric, expected.dram_metric)
    if expected.metric_set is not None:
        assert choice.metric_set == expected.metric_set
    # Whatever set was chosen offers both names, less their rollups.
    assert choice.metric_set is not None
    offered = dict(sets)[choice.metric_set]
    assert all(split_name(m)[0] + split_name(m)[1] in offered for m in choice.metrics)


def test_gh100_without_the_sector_counter_takes_the_user_metric_by_its_full_name() -> None:
    [(name, metrics)] = sets_of("13.4.92", "gh100")
    without = [m for m in metrics if "dramc__sectors" not in m]

    choice = choose_from_sets([(name, without)])

    assert choice == MetricChoice(SM, GH100_PCT, "Compute_Triage", active_metric=GH100_ACTIVE)
    assert choice is not None and choice.dram_is_ratio


def test_an_sm_only_set_choice_comes_after_every_pair() -> None:
    sm_only = MetricChoice(SM, None, "S")
    order = [c for c, _ in ordered_choices([sm_only])]

    first_single = next(i for i, c in enumerate(order) if not c.is_pair)
    assert order[first_single] == sm_only
    assert all(c.is_pair for c in order[:first_single]) and first_single > 0


@pytest.mark.parametrize(
    ("said", "unit", "per_unit", "basis"),
    [("sectors", "sectors", SECTOR_BYTES, BASIS_CUPTI), ("sector", "sectors", 32, BASIS_CUPTI),
     ("bytes", "bytes", 1, BASIS_CUPTI), (None, "sectors", SECTOR_BYTES, BASIS_NAME)],
)
def test_sectors_become_bytes_by_the_unit_cupti_states_else_by_the_name(
    said: str | None, unit: str, per_unit: int, basis: str,
) -> None:
    choice = with_unit(MetricChoice(SM, GH100_SECTORS, "Compute_Triage"), lambda m: said)

    assert choice is not None
    assert (choice.dram_unit, choice.dram_bytes_per_unit, choice.dram_unit_basis) == (
        unit, per_unit, basis)


def test_a_dram_count_in_an_unknown_unit_is_not_counted_as_bytes() -> None:
    assert with_unit(MetricChoice(SM, GH100_SECTORS), lambda m: "cycles") is None
    kept = with_unit(MetricChoice(SM, None), lambda m: "cycles")
    assert kept == MetricChoice(SM, None)


def _sampler(device: FakeDevice, *, properties_api: bool = False,
             set_api: bool = True) -> tuple[CuptiPmSampler, FakeCupti]:
    lib = FakeCupti({0: device}, properties_api=properties_api, set_api=set_api)
    gpu = GPUIdentity(0, fake_uuid(0), "NVIDIA H200")
    return CuptiPmSampler([gpu], lib=lib, cuda=CudaDriver(lib.driver)), lib


@pytest.mark.parametrize("version", VERSIONS)
def test_an_h200_counts_dram_sectors_as_32_bytes_each_by_cuptis_unit(version: str) -> None:
    device = real_device(version, "gh100",
                         decodes=[[{SM: 1000.0, GH100_SECTORS: 10.0}, {SM: 500.0,
                                                                        GH100_SECTORS: 5.0}]])
    sampler, lib = _sampler(device, properties_api=True)

    [sample] = sampler.sample_profiling()

    assert lib.collectors[0].metrics == [SM, GH100_SECTORS, GH100_ACTIVE]
    assert lib.collectors[0].config["single_pass_metric_set_name"] == "Compute_Triage"
    assert sample.sm_instructions_executed_total == 1500.0
    assert sample.dram_read_bytes_total == 15 * 32
    assert (sample.dram_unit, sample.dram_unit_basis) == ("sectors", BASIS_CUPTI)
    assert GH100_SECTORS in lib.properties_asked
    assert sampler.status() == ("ok", "")


def test_without_cuptis_metric_properties_the_unit_comes_from_the_name() -> None:
    device = real_device("13.4.92", "gh100", decodes=[[{SM: 1.0, GH100_SECTORS: 2.0}]])
    sampler, _ = _sampler(device)

    [sample] = sampler.sample_profiling()

    assert sample.dram_read_bytes_total == 64.0
    assert (sample.dram_unit, sample.dram_unit_basis) == ("sectors", BASIS_NAME)


def test_a_sector_metric_cupti_gives_another_unit_falls_to_the_throughput_user_metric() -> None:
    device = real_device("13.4.92", "gh100", metric_units={"dramc__sectors_op_read": "cycles"},
                         decodes=[[{SM: 1.0, GH100_PCT: 30.0}]])
    sampler, lib = _sampler(device, properties_api=True)

    [sample] = sampler.sample_profiling()

    assert lib.collectors[0].metrics == [SM, GH100_PCT, GH100_ACTIVE]
    assert sample.dram_read_bytes_total is None
    assert sample.dram_read_throughput_ratio == pytest.approx(0.3)


def test_an_sm_only_set_does_not_stop_a_pair_the_chip_accepts_without_a_set() -> None:
    device = FakeDevice(single_pass_sets={"SmOnly": ["sm__inst_executed_realtime"]},
                        supported_metrics=frozenset({SM, "dram__sectors_op_read.sum"}),
                        decodes=[[{SM: 4.0, "dram__sectors_op_read.sum": 1.0}]])
    sampler, lib = _sampler(device)

    [sample] = sampler.sample_profiling()

    assert lib.collectors[0].metrics == [SM, "dram__sectors_op_read.sum"]
    assert "single_pass_metric_set_name" not in lib.collectors[0].config
    assert sample.dram_read_bytes_total == 32.0


def test_the_bare_user_metric_name_is_refused_where_the_set_lists_it_with_its_prefix() -> None:
    lib = FakeCupti({0: real_device("13.4.92", "gh100")})
    collector = lib.pm_sampling.Collector(0)
    lib.driver.cuInit(0)
    collector.enable()

    with pytest.raises(ValueError):
        bare = "dramc__read_throughput.avg.pct_of_peak_sustained_elapsed"
        collector.configure(metrics=[SM, bare],
                            hardware_buffer_size=1 << 20, sampling_interval=100_000_000,
                            single_pass_metric_set_name="Compute_Triage")
    collector.configure(metrics=[SM, GH100_PCT], hardware_buffer_size=1 << 20,
                        sampling_interval=100_000_000,
                        single_pass_metric_set_name="Compute_Triage")


def _update(device: FakeDevice, **lib_options: bool) -> tuple[list, PassView]:
    sampler, _ = _sampler(device, **lib_options)
    view, samples = run_pass(pass_view(), [ProfilingCollector(sampler)])
    return samples, view


def test_the_info_metric_states_the_conversion_basis() -> None:
    device = real_device("13.4.92", "gh100", decodes=[[{SM: 1.0, GH100_SECTORS: 2.0}]])

    samples, view = _update(device, properties_api=True)

    [(_, values, _)] = [s for s in samples if s[0] == PROFILING_METRICS_INFO.name]
    labels = dict(zip(PROFILING_METRICS_INFO.labels, values, strict=True))
    assert (labels["dram_metric"], labels["dram_unit"], labels["dram_unit_bytes"],
            labels["dram_unit_basis"]) == (GH100_SECTORS, "sectors", "32", BASIS_CUPTI)
    assert view.get(ProfilingStatus) == ProfilingStatus("ok", "")
    assert compute_memory_source(view) == [
        (profiling.COMPUTE_MEMORY_SOURCE.name, ("cupti_pm_sampling", "ok"), {})]


@pytest.mark.parametrize("gpm", [True, False])
def test_one_counter_alone_is_degraded_never_ok(gpm: bool) -> None:
    device = real_device("13.4.92", "gb20b", decodes=[[{SM: 1.0}]])

    _, view = _update(device)
    if gpm:
        view = view.with_outputs([GpmReadings(())])  # the gpm collector sampled

    status = view.get(ProfilingStatus)
    assert status is not None and status.reason == "degraded"
    assert "DRAM read byte" in status.detail
    source = "gpm_activity_proxy" if gpm else "none"
    assert compute_memory_source(view) == [
        (profiling.COMPUTE_MEMORY_SOURCE.name, (source, "degraded"), {})]


def test_a_throughput_ratio_is_no_byte_counter_so_it_is_degraded_too() -> None:
    gpu = GPUIdentity(0, fake_uuid(0), "NVIDIA H200")
    assert profiling._missing_side(ProfilingSample(gpu, 1.0, None, 0.4)) == "DRAM read byte"
    assert profiling._missing_side(ProfilingSample(gpu, None, 8.0)) == "SM instruction"
    assert profiling._missing_side(ProfilingSample(gpu, 1.0, 8.0)) == ""
    assert profiling._missing_side(ProfilingSample(gpu)) == ""
