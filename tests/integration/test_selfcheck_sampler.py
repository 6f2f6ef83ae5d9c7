"""The self-check's CUPTI sampler in a process of its own, the readers keyed by UUID, and the
dry device's GH100 sets.

- :class:`SamplerProcess` really starts ``python -m mrc_agent.agent.tools.selfcheck.sampler``:
  on this GPU-less machine the agent's sampler there answers "unavailable", and the report
  says the process never imported torch;
- a MIG device shares its parent's index: both rows survive a poll;
- the shipped GH100 set equals ``tests/data/cupti_sets/cupti-13.4.92.json``'s GH100 entry, and
  the dry CUPTI answers the sets API and refuses names the chip lacks as cupti-python does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrc_agent.agent.core.hw.base import DeviceSample, GPUIdentity, SourceUnavailable
from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler
from mrc_agent.agent.tools.selfcheck.dry import DryModel
from mrc_agent.agent.tools.selfcheck.dry_device import DryCupti
from mrc_agent.agent.tools.selfcheck.phases import AgentReaders
from mrc_agent.agent.tools.selfcheck.sampler import (
    LocalSampler,
    SamplerProcess,
    SamplerServer,
    mapped_libraries,
)
from mrc_agent.agent.tools.simgpu.chips import extract, load_sets

SETS = Path(__file__).parents[1] / "data" / "cupti_sets" / "cupti-13.4.92.json"


def test_the_sampler_process_reports_without_torch(tmp_path: Path) -> None:
    gpu = GPUIdentity(0, "GPU-00000000-0000-0000-0000-000000000000", "none")
    proc = SamplerProcess(gpu, 0.1, log_path=tmp_path / "sampler.log")
    try:
        with pytest.raises(SourceUnavailable):  # no libcuda / no GPU on this machine
            proc.sample_profiling()
        report = proc.report()
    finally:
        proc.close()
    assert report["pid"] == proc.pid and report["own_process"] is True
    assert report["torch_imported"] is False and report["started"] is False
    assert report["statuses"] and report["statuses"][-1][0] != "ok"
    assert {w["name"] for w in report["libcupti"]["wheels"]} == {"nvidia-cuda-cupti",
                                                                 "cupti-python"}


def test_the_dry_sampler_reports_the_sets_api_answers() -> None:
    model = DryModel(gpus=1)
    cupti = DryCupti(model)
    gpu = GPUIdentity(0, model.uuid(0), model.name)
    local = LocalSampler(SamplerServer(CuptiPmSampler([gpu], lib=cupti), gpu, lib=cupti))
    try:
        local.sample_profiling()
        report = local.report()
    finally:
        local.close()
    answers = report["cupti"]
    assert answers["chip"] == "gh100" and answers["supported_chips"] == ["gh100"]
    assert answers["single_pass_sets"] == ["Compute_Triage"]
    assert answers["metrics_in_set"]["Compute_Triage"] == load_sets()["metrics"]
    assert set(answers["metric_properties"]) == set(report["metrics"])


def test_mapped_libraries_reads_proc_maps(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f-7f r-xp 0 08:01 1 /venv/nvidia/cu13/lib/libcupti.so.13\n"
                    "7f-7f r--p 0 08:01 1 /venv/nvidia/cu13/lib/libcupti.so.13\n"
                    "7f-7f r-xp 0 08:01 2 /usr/lib/libc.so.6\n")
    assert mapped_libraries(maps=maps) == ["/venv/nvidia/cu13/lib/libcupti.so.13"]


def test_a_mig_row_does_not_overwrite_its_parent() -> None:
    parent = GPUIdentity(0, "GPU-aaaa", "H200")
    mig = GPUIdentity(0, "MIG-bbbb", "H200 MIG 1g.18gb")

    class Source:
        def sample_devices(self) -> list[DeviceSample]:
            return [DeviceSample(parent, gpu_util=0.5), DeviceSample(mig, gpu_util=0.25)]

    poll = AgentReaders(Source(), None, None, 1.0, 0.1).poll()  # type: ignore[arg-type]
    assert {k: s.gpu_util for k, s in poll.devices.items()} == {"GPU-aaaa": 0.5,
                                                                "MIG-bbbb": 0.25}


def test_the_shipped_gh100_set_is_the_wheels() -> None:
    assert load_sets() == extract(json.loads(SETS.read_text()))
    assert "dramc__sectors_op_read" in load_sets()["metrics"]


def test_the_dry_cupti_answers_like_cupti_python() -> None:
    model = DryModel(gpus=1)
    cupti = DryCupti(model)
    host = cupti.profiler_host
    assert host.get_single_pass_sets("gh100") == ["Compute_Triage"]
    with pytest.raises(ValueError):
        host.get_single_pass_sets("ga100")
    with pytest.raises(ValueError):
        host.get_metrics_in_single_pass_set("gh100", "Top_Level_Triage")
    collector = cupti.pm_sampling.Collector(device_index=0)
    collector.enable()
    common = {"hardware_buffer_size": 1 << 20, "sampling_interval": 100_000_000,
              "trigger_mode": cupti.pm_sampling.TriggerMode.GPU_TIME_INTERVAL}
    with pytest.raises(ValueError):
        collector.configure(metrics=["sm__inst_executed_realtime.sum", "dram__bytes_read.sum"],
                            **common)
    collector.configure(metrics=["sm__inst_executed_realtime.sum", "dramc__sectors_op_read.sum",
                                 "Compute_Triage.dramc__read_throughput.avg."
                                 "pct_of_peak_sustained_elapsed"],
                        single_pass_metric_set_name="Compute_Triage", **common)
    ph = host.ProfilerHost("gh100", host.ProfilerType.PM_SAMPLING)
    ph.initialize()
    assert ph.get_metric_properties("dramc__sectors_op_read.sum").dim_unit == "sectors"
    with pytest.raises(ValueError):
        ph.get_metric_properties("dram__bytes_read.sum")
