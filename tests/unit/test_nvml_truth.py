"""The NVML readings whose units, scopes and clocks NVML leaves open, checked at run time:
PCIe byte counters (with wraps and resets) before the throughput call, the NVLink aggregate
scope against per-link reads, the utilisation-sample clock, the non-deprecated temperature
call, the ``_v2`` process lists, and the whole adapter on the oldest nvidia-ml-py the project
declares (12.535), loaded from its real wheel."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pynvml
import pytest

from mrc_agent.agent.core.hw.base import HardwareError
from mrc_agent.agent.core.hw.nvml import NvmlBackend
from mrc_agent.agent.core.hw.nvml.device import default_sample_clocks
from mrc_agent.agent.core.hw.nvml.gpm import MIN_GPM_INTERVAL_S, check_gpm_interval
from mrc_agent.agent.core.hw.nvml.pcie_counters import unwrap
from mrc_agent.agent.core.hw.nvml.units import CLOCK_MATCH_S, identify_clock
from mrc_agent.agent.tools.simgpu import nvml as fake_pynvml
from mrc_agent.agent.tools.simgpu.nvml import FakeNvml, gpu, nvlink
from tests.conftest import REPO
from tests.nvml_support import (
    MONO_NOW,
    NVML_LOGGER,
    UUID0,
    UUID1,
    WALL_NOW,
    counted,
    load_fake_for,
)
from tests.nvml_support import FakeClock as Clock

#: Where .ci/run puts the oldest nvidia-ml-py the project declares (pyproject: >=12.535).
OLD_PYNVML_WHEEL = Path(os.environ.get(
    "MRC_OLD_PYNVML_WHEEL", REPO / "build" / "compat" / "nvidia_ml_py-12.535.161-py3-none-any.whl"))


def backend(fake: Any, clock: Clock | None = None, **kwargs: Any) -> NvmlBackend:
    return NvmlBackend(lib=fake, clock=clock or Clock(), wall_clock=lambda: WALL_NOW,
                       pcie_thread=False, **kwargs)


# --- PCIe byte counters ---------------------------------------------------------------------

#: A count past 2^32: the counter is known 64 bits wide (below it, it is taken as 32 bits
#: whatever type NVML names, and reads a second apart are too far apart to count).
WIDE = 2**40


def test_pcie_byte_counters_give_totals_and_rates_and_no_throughput_thread() -> None:
    clock = Clock()
    fake = FakeNvml([gpu(pcie_count=counted(WIDE + 1_000, WIDE + 50_000))])
    b = NvmlBackend(lib=fake, clock=clock, wall_clock=lambda: WALL_NOW)  # thread allowed
    try:
        [s] = b.sample_devices()
        assert (s.pcie_tx_bytes_total, s.pcie_rx_bytes_total) == (0.0, 0.0)  # from here on
        assert s.pcie_tx_bytes_per_second is None  # no rate from one reading
        assert s.sources["pcie"] == "byte_counters"
        clock.now += 2.0
        fake.gpus[0]["pcie_count"] = counted(WIDE + 5_000, WIDE + 50_000 + 10_000_000)
        [s] = b.sample_devices()
        assert (s.pcie_tx_bytes_total, s.pcie_rx_bytes_total) == (4_000, 10_000_000)
        assert s.pcie_tx_bytes_per_second == 2_000 and s.pcie_rx_bytes_per_second == 5_000_000
        assert b._pcie.thread is None  # every GPU has counters: no 20 ms reads at all
        assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0
    finally:
        b.close()


def test_pcie_throughput_call_is_the_fallback_only_for_gpus_without_counters() -> None:
    fake = FakeNvml([gpu(index=0, pcie_count=counted(0, 0)), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    b._pcie.run_round()
    s0, s1 = b.sample_devices()
    assert (s0.sources["pcie"], s1.sources["pcie"]) == ("byte_counters", "throughput_call")
    assert s1.pcie_tx_bytes_per_second == 1000 * 1024 and s1.pcie_tx_bytes_total is None
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 2  # TX and RX of GPU 1 only


def test_pcie_counter_wrap_at_32_bits_is_undone_and_a_reset_counts_from_zero() -> None:
    clock = Clock()
    u32 = "NVML_VALUE_TYPE_UNSIGNED_INT"
    fake = FakeNvml([gpu(pcie_count=counted(2**32 - 1_000, 0, u32))])
    b = backend(fake, clock)
    b.sample_devices()
    clock.now += 0.02  # within the 67 ms a Gen5 x16 link needs to wrap it again
    fake.gpus[0]["pcie_count"] = counted(2**32 + 3_000, 0, u32)  # wraps to 3000
    [s] = b.sample_devices()
    assert s.pcie_tx_bytes_total == 4_000
    assert s.pcie_tx_bytes_per_second == pytest.approx(4_000 / 0.02)
    # A 64-bit counter that goes down did not wrap: the driver restarted it.
    assert unwrap(10_000, 700, 64, 1.0) == 700
    # A 32-bit "wrap" bigger than any link carries in the time is a reset too.
    assert unwrap(100, 50, 32, 0.001) == 50
    assert unwrap(2**32 - 10, 5, 32, 0.01) == 15
    # Read a second apart, a 32-bit counter may have wrapped any number of times.
    assert unwrap(2**32 - 10, 5, 32, 1.0) is None


def test_pcie_totals_never_go_down_across_an_nvml_reinit() -> None:
    clock = Clock()
    fake = FakeNvml([gpu(pcie_count=counted(WIDE + 100, WIDE + 100))])
    b = backend(fake, clock)
    b.sample_devices()
    fake.gpus[0]["pcie_count"] = counted(WIDE + 600, WIDE + 100)
    clock.now += 1
    assert b.sample_devices()[0].pcie_tx_bytes_total == 500
    fake.lose_gpu(0)
    with pytest.raises(HardwareError):
        b.sample_devices()
    fake.restore_gpu(0)
    fake.gpus[0]["pcie_count"] = counted(50, 100)  # the driver reset the counter meanwhile
    clock.now += 1
    [s] = b.sample_devices()
    assert s.pcie_tx_bytes_total == 550


# --- NVLink aggregate scope ------------------------------------------------------------------


def links18(kib: int) -> dict[int, dict[str, Any]]:
    return {i: nvlink(kib, 2 * kib) for i in range(18)}


def test_nvlink_totals_are_the_aggregate_and_per_link_kept_when_they_sum_to_it() -> None:
    fake = FakeNvml([gpu(nvlink=links18(10))])
    [s] = backend(fake).sample_devices()
    assert s.nvlink_tx_bytes_total == 18 * 10 * 1024
    assert len(s.nvlink_links) == 18 and s.sources["nvlink"] == "aggregate"


def test_per_link_reads_answering_the_aggregate_are_dropped_not_summed_18_times() -> None:
    fake = FakeNvml([gpu(nvlink=links18(10), nvlink_per_link_is_aggregate=True)])
    b = backend(fake)
    for _ in range(2):
        [s] = b.sample_devices()
    assert s.nvlink_tx_bytes_total == 18 * 10 * 1024  # not 18 * 18 * 10 KiB
    assert s.nvlink_links == {} and s.sources["nvlink"] == "aggregate"


def test_without_the_aggregate_scope_repeated_per_link_counts_are_taken_once() -> None:
    fake = FakeNvml([gpu(nvlink=links18(10), nvlink_per_link_is_aggregate=True,
                         nvlink_aggregate_scope=False)])
    [s] = backend(fake).sample_devices()
    assert s.nvlink_tx_bytes_total == 18 * 10 * 1024
    assert s.nvlink_links == {} and s.sources["nvlink"] == "per_link_repeats_aggregate"
    honest = FakeNvml([gpu(nvlink={0: nvlink(1, 2), 1: nvlink(3, 4)},
                           nvlink_aggregate_scope=False)])
    [s] = backend(honest).sample_devices()
    assert s.nvlink_tx_bytes_total == 4 * 1024 and s.sources["nvlink"] == "per_link_sum"


# --- the utilisation-sample clock -------------------------------------------------------------


def test_identify_clock_picks_the_clock_the_timestamp_is_on() -> None:
    nows = {"realtime": WALL_NOW, "boottime": 1_000.0, "monotonic": 990.0}
    assert identify_clock(int((WALL_NOW - 2) * 1e6), nows) == "realtime"
    assert identify_clock(int(998 * 1e6), nows) == "boottime"
    assert identify_clock(int(989 * 1e6), nows) == "monotonic"
    assert identify_clock(int(5e6), nows) is None  # fits none: not used
    assert identify_clock(int((WALL_NOW + 30) * 1e6), nows) is None  # in the future


@pytest.mark.parametrize("clock_name, stamp_s", [("realtime", WALL_NOW - 3.0), ("boottime", 797.0)])
def test_util_samples_on_either_clock_land_at_the_right_monotonic_time(
    clock_name: str, stamp_s: float
) -> None:
    fake = FakeNvml([gpu(util_samples=[(int(stamp_s * 1e6), 40)])])
    clocks = {"realtime": lambda: WALL_NOW, "boottime": lambda: 800.0,
              "monotonic": lambda: 10.0}
    b = NvmlBackend(lib=fake, clock=Clock(), sample_clocks=clocks, pcie_thread=False)
    [s] = b.sample_devices()
    assert s.sources["util_clock"] == clock_name
    assert s.util_samples == [(pytest.approx(MONO_NOW - 3.0), 0.4)]


def test_util_samples_on_no_known_clock_are_not_used() -> None:
    fake = FakeNvml([gpu(util_samples=[(12_345_678, 40)])])
    [s] = backend(fake).sample_devices()
    assert s.util_samples == [] and s.sources["util_clock"] == "unknown"
    assert s.gpu_util == 0.5  # the plain utilisation is still there


# --- deprecated calls and older drivers ------------------------------------------------------


def test_temperature_uses_the_versioned_call_and_falls_back_to_the_old_one() -> None:
    fake = FakeNvml([gpu(temperature_c=55)])
    [s] = backend(fake).sample_devices()
    assert s.temperature_celsius == 55
    assert fake.calls["nvmlDeviceGetTemperatureV"] == 1
    assert fake.calls["nvmlDeviceGetTemperature"] == 0
    old_driver = FakeNvml([gpu(temperature_c=56, not_supported={"nvmlDeviceGetTemperatureV"})])
    b = backend(old_driver)
    for _ in range(2):
        [s] = b.sample_devices()
    assert s.temperature_celsius == 56 and old_driver.calls["nvmlDeviceGetTemperatureV"] == 1


class V2OnlyDriver(FakeNvml):
    """A driver without the ``_v3`` process-list entry points, under a current nvidia-ml-py."""

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._count("nvmlDeviceGetComputeRunningProcesses")
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v2", handle,
                               "compute_processes")


def test_process_list_falls_back_to_v2_on_a_driver_without_v3() -> None:
    fake = V2OnlyDriver([gpu(compute_processes=[(4242, 3 * 2**30)])])
    b = backend(fake)
    for _ in range(2):
        [s] = b.sample_devices()
    assert s.process_memory_bytes == {4242: 3 * 2**30}
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 1  # remembered, not retried


def test_nan_from_the_library_never_reaches_a_sample() -> None:
    fake = FakeNvml([gpu()])

    class NanPower(type(fake)):  # type: ignore[misc]
        def nvmlDeviceGetPowerUsage(self, handle: Any) -> float:
            self._gpu("nvmlDeviceGetPowerUsage", handle)
            return float("nan")

    fake.__class__ = NanPower
    [s] = backend(fake).sample_devices()
    assert s.power_watts is None and s.temperature_celsius == 40


# --- the oldest declared nvidia-ml-py, its real module -----------------------------------------


def _load_old_pynvml() -> Any:
    if not OLD_PYNVML_WHEEL.is_file():
        pytest.fail(f"{OLD_PYNVML_WHEEL} is missing: .ci/run downloads it (pip download "
                    "--no-deps nvidia-ml-py==12.535.161 -d build/compat)")
    source = zipfile.ZipFile(OLD_PYNVML_WHEEL).read("pynvml.py")
    if "pynvml_12_535" in sys.modules:
        return sys.modules["pynvml_12_535"]
    spec = importlib.util.spec_from_loader("pynvml_12_535", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pynvml_12_535"] = module  # it looks itself up there while it loads
    exec(compile(source, f"{OLD_PYNVML_WHEEL}/pynvml.py", "exec"), module.__dict__)
    return module


def test_the_adapter_runs_on_nvidia_ml_py_12_535_real_module() -> None:
    old = _load_old_pynvml()
    assert not hasattr(old, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES")  # what makes it the old one
    assert not hasattr(old, "nvmlDeviceGetTemperatureV")
    fake_mod = load_fake_for(old)
    fake = fake_mod.FakeNvml([fake_mod.gpu(
        gpm={old.NVML_GPM_METRIC_SM_UTIL: 70.0, old.NVML_GPM_METRIC_DRAM_BW_UTIL: 30.0},
        nvlink={0: fake_mod.nvlink(5, 6)}, compute_processes=[(7, 2**30)],
        pcie_count={"tx_bytes": 10, "rx_bytes": 20,
                    "value_type": "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG"})])
    assert isinstance(fake.NVMLError(1), old.NVMLError)  # that version's own error classes
    b = NvmlBackend(lib=fake, clock=Clock(), wall_clock=lambda: WALL_NOW, pcie_thread=False,
                    gpm_clock=iter(range(0, 100, 2)).__next__)
    b.sample_devices()
    b._pcie.run_round()
    [s] = b.sample_devices()
    assert s.sources["pcie"] == "throughput_call"  # no byte-count fields in 12.535
    assert s.pcie_tx_bytes_per_second == 1000 * 1024
    assert s.temperature_celsius == 40  # the only temperature call 12.535 has
    assert s.nvlink_tx_bytes_total == 5 * 1024 and s.process_memory_bytes == {7: 2**30}
    b.sample_gpm()
    [g] = b.sample_gpm()
    assert g.sm_util == pytest.approx(0.7) and g.dram_bw_util == pytest.approx(0.3)
    info = b.info()
    assert info["available"] and info["gpus"][0]["gpm_supported"] is True
    b.close()


def test_doctor_prints_both_pcie_readings_and_the_live_paths_side_by_side() -> None:
    import io

    from mrc_agent.agent.core.config import AgentConfig
    from mrc_agent.agent.tools.doctor import run_doctor

    fake = FakeNvml([gpu(index=0, pcie_count=counted(0, 0), nvlink={0: nvlink(1, 1)},
                         util_samples=[(int((WALL_NOW - 1) * 1e6), 10)]),
                     gpu(index=1, pcie={"tx_kb_per_s": 2000, "rx_kb_per_s": 4000, "replays": 0})])
    out = io.StringIO()
    assert run_doctor(AgentConfig(gpu_backend="nvml"), set(), False, out=out, nvml_lib=fake) == 0
    text = out.getvalue()
    [g0] = [line for line in text.splitlines() if "GPU 0 readings" in line]
    [g1] = [line for line in text.splitlines() if "GPU 1 readings" in line]
    assert "PCIe from byte_counters (counters TX 0.0 MB/s RX 0.0 MB/s | throughput call TX " \
           "1.0 MB/s RX 2.0 MB/s); NVLink aggregate" in g0
    assert "PCIe from throughput_call (counters TX - RX - | throughput call TX 2.0 MB/s" in g1
    assert "NVLink none" in g1
    assert "GPM window" in text and "1 s (--gpm-interval)" in text


# --- MIG --------------------------------------------------------------------------------------


def mig_gpu() -> dict[str, Any]:
    sm = pynvml.NVML_GPM_METRIC_SM_UTIL
    return gpu(gpm={sm: 90.0}, compute_processes=[],
               mig=[fake_pynvml.mig_device(1, gpm={sm: 30.0}, compute_processes=[(11, 2**30)]),
                    fake_pynvml.mig_device(2, gpm={sm: 60.0})])


def test_mig_devices_get_their_own_series_with_memory_and_processes() -> None:
    fake = FakeNvml([mig_gpu()])
    whole, gi1, gi2 = backend(fake).sample_devices()
    assert whole.gpu.uuid.startswith("GPU-") and whole.gpu_util is None  # not in MIG mode
    assert whole.power_watts == 300.0  # device-wide readings stay on the physical GPU
    assert (gi1.gpu.uuid, gi1.gpu.index, gi1.gpu.name) == (
        "MIG-00000001-fake-mig-uuid", 0, "NVIDIA H100 80GB HBM3 MIG GI 1")
    assert gi1.mem_total_bytes == 18 * 2**30 and gi1.process_memory_bytes == {11: 2**30}
    assert gi2.gpu.uuid == "MIG-00000002-fake-mig-uuid" and gi2.gpu_util is None


def test_mig_gpm_is_sampled_per_gpu_instance_not_for_the_whole_gpu() -> None:
    fake = FakeNvml([mig_gpu()])
    b = NvmlBackend(lib=fake, clock=Clock(), pcie_thread=False,
                    gpm_clock=iter(range(0, 100, 2)).__next__)
    assert b.sample_gpm() == []  # primes both instances
    gi1, gi2 = b.sample_gpm()
    assert gi1.gpu.uuid.startswith("MIG-00000001") and gi1.sm_util == pytest.approx(0.3)
    assert gi2.sm_util == pytest.approx(0.6)
    assert fake.calls["nvmlGpmSampleGet"] == 0 and fake.calls["nvmlGpmMigSampleGet"] == 4
    b.close()
    assert fake.calls["nvmlGpmSampleFree"] == 4  # each instance's two buffers


def test_doctor_says_mig_and_what_is_not_available() -> None:
    import io

    from mrc_agent.agent.core.config import AgentConfig
    from mrc_agent.agent.tools.doctor import run_doctor

    out = io.StringIO()
    run_doctor(AgentConfig(gpu_backend="nvml"), set(), False, out=out,
               nvml_lib=FakeNvml([mig_gpu()]))
    [line] = [x for x in out.getvalue().splitlines() if "GPU 0 MIG" in x]
    assert "2 MIG device(s) (MIG-00000001-fake-mig-uuid, MIG-00000002-fake-mig-uuid)" in line
    assert "GPM per GPU instance" in line and "not available in MIG mode: GPU" in line


# --- what the mutation run found: per-GPU memory, messages, boundaries -----------------------



def messages(caplog: pytest.LogCaptureFixture, part: str) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if part in r.getMessage()]


def test_pcie_counters_are_kept_per_gpu_and_a_gpu_without_them_is_asked_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    fake = FakeNvml([gpu(index=0), gpu(index=1, pcie_count=counted(WIDE, WIDE)),
                     gpu(index=2, pcie_count=counted(WIDE, WIDE))])
    b = backend(fake, clock)
    with caplog.at_level(logging.INFO, logger=NVML_LOGGER):
        b.sample_devices()
        clock.now += 1.0
        fake.gpus[1]["pcie_count"] = counted(WIDE + 100, WIDE + 200)
        fake.gpus[2]["pcie_count"] = counted(WIDE + 7, WIDE + 9)
        _, s1, s2 = b.sample_devices()
        b.sample_devices()
    assert (s1.pcie_tx_bytes_total, s1.pcie_rx_bytes_total) == (100, 200)
    assert (s2.pcie_tx_bytes_total, s2.pcie_rx_bytes_total) == (7, 9)
    assert (s1.pcie_tx_bytes_per_second, s1.pcie_rx_bytes_per_second) == (100, 200)
    # No GPU has a link: one field read each for the link count; GPU 0 one for the PCIe
    # counters it lacks, never again; GPUs 1 and 2 one per sample.
    assert fake.calls["nvmlDeviceGetFieldValues"] == 3 + 1 + 2 * 3
    tx_id = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
    assert messages(caplog, "byte counters") == [(
        "INFO", f"GPU 0 ({UUID0}): no PCIe byte counters (the driver lacks field {tx_id}); "
        "PCIe rates come from the 20 ms throughput call")]


def test_pcie_counters_on_an_old_library_say_why_and_a_failing_field_fails_the_sample(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class OldLibrary(FakeNvml):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("NVML_FI_DEV_PCIE_COUNT"):
                raise AttributeError(name)
            return super().__getattr__(name)

    with caplog.at_level(logging.INFO, logger=NVML_LOGGER):
        backend(OldLibrary([gpu(pcie_count=counted(1, 1))])).sample_devices()
    assert messages(caplog, "byte counters") == [(
        "INFO", f"GPU 0 ({UUID0}): no PCIe byte counters (this nvidia-ml-py has no PCIe "
        "byte-count fields); PCIe rates come from the 20 ms throughput call")]
    lost = pynvml.NVML_ERROR_GPU_IS_LOST
    fake = FakeNvml([gpu(pcie_count=counted(1, 1),
                         field_errors={pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: lost})])
    with pytest.raises(HardwareError, match=f"code {lost}"):
        backend(fake).sample_devices()


def test_pcie_counters_refuse_an_answer_for_other_fields() -> None:
    class Confused(FakeNvml):
        def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
            values = super().nvmlDeviceGetFieldValues(handle, fieldIds)
            if pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES in fieldIds:
                values[0].fieldId = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES  # RX twice, no TX
            return values

    with pytest.raises(HardwareError, match="GPU 0: NVML answered other fields than asked"):
        backend(Confused([gpu(pcie_count=counted(1, 1))])).sample_devices()


def test_unwrap_at_its_edges() -> None:
    assert unwrap(5, 5, 32, 0.01) == 0  # no traffic is no wrap
    assert unwrap(2**32 - 1, 0, 32, 0.01) == 1
    assert unwrap(10, 3, None, 1.0) == 3  # an unknown width: a reset


def test_doctor_comparison_reads_both_directions_over_one_window() -> None:
    clock = Clock()
    fake = FakeNvml([gpu(index=0, pcie_count=counted(WIDE + 1_000, WIDE + 2_000)),
                     gpu(index=1, not_supported={"nvmlDeviceGetPcieThroughput"}),
                     gpu(index=2)])
    b = backend(fake, clock)
    b.sample_devices()

    def wait(seconds: float) -> None:
        clock.now += 2.0
        fake.gpus[0]["pcie_count"] = counted(WIDE + 1_600, WIDE + 3_000)

    rows = b.compare_pcie(seconds=2.0, sleep=wait)
    assert rows[UUID0] == {"counter_tx": 300, "counter_rx": 500, "call_tx": 1000 * 1024,
                           "call_rx": 2000 * 1024}
    assert rows[UUID1] == {"counter_tx": None, "counter_rx": None, "call_tx": None,
                           "call_rx": None}
    assert rows["GPU-00000002-fake-uuid"]["call_tx"] == 1000 * 1024  # GPU 1 did not stop it
    assert "pcie_throughput" in b.info()["gpus"][1]["unsupported"]


def test_nvlink_faults_are_remembered_per_gpu(caplog: pytest.LogCaptureFixture) -> None:
    distinct = {i: nvlink(10 + i, 20 + i) for i in range(18)}
    fake = FakeNvml([
        gpu(index=0, nvlink=links18(10), nvlink_per_link_is_aggregate=True),
        gpu(index=1, nvlink=links18(10)),
        gpu(index=2, nvlink=distinct, nvlink_aggregate_scope=False),
        gpu(index=3, nvlink=distinct),
    ])
    b = backend(fake)
    with caplog.at_level(logging.INFO, logger=NVML_LOGGER):
        for _ in range(2):
            s0, s1, s2, s3 = b.sample_devices()
    assert s0.nvlink_links == {} and len(s1.nvlink_links) == 18  # GPU 0's fault is its own
    assert s2.sources["nvlink"] == "per_link_sum" and s3.sources["nvlink"] == "aggregate"
    assert messages(caplog, "sum to") == [(
        "WARNING", f"GPU 0 ({UUID0}): NVLink per-link byte counts sum to {18 * 18 * 10240}, the "
        f"aggregate is {18 * 10240}; per-link series dropped, totals from the aggregate")]


def test_nvlink_per_link_within_the_tolerance_is_kept_beyond_it_dropped() -> None:
    total_kib = 18 * 1000
    near = FakeNvml([gpu(nvlink=links18(1000), nvlink_aggregate_extra_kib=total_kib // 100)])
    [s] = backend(near).sample_devices()
    assert len(s.nvlink_links) == 18  # 1 % apart: traffic between two reads of one call
    far = FakeNvml([gpu(nvlink=links18(1000), nvlink_aggregate_extra_kib=total_kib // 20)])
    [s] = backend(far).sample_devices()
    assert s.nvlink_links == {} and s.nvlink_tx_bytes_total == 1.05 * total_kib * 1024


def test_nvlink_aggregate_refused_for_one_direction_falls_back_to_the_links(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    fake = FakeNvml([gpu(nvlink={0: nvlink(1, 2), 1: nvlink(3, 4)},
                         fields_not_supported={(rx, 0xFFFFFFFF)})])
    [s] = backend(fake).sample_devices()
    assert s.sources["nvlink"] == "per_link_sum" and s.nvlink_rx_bytes_total == 6 * 1024
    two_same = FakeNvml([gpu(nvlink={0: nvlink(5, 5), 1: nvlink(5, 5)},
                             nvlink_per_link_is_aggregate=True, nvlink_aggregate_scope=False)])
    with caplog.at_level(logging.INFO, logger=NVML_LOGGER):
        [s] = backend(two_same).sample_devices()
    assert s.sources["nvlink"] == "per_link_repeats_aggregate"  # two links are enough to tell
    assert messages(caplog, "same byte count") == [(
        "WARNING", f"GPU 0 ({UUID0}): every NVLink link reports the same byte count; taking it "
        "as the total and dropping per-link series")]


def test_identify_clock_edges() -> None:
    nows = {"boottime": 1000.0}
    assert identify_clock(1000 * 10**6, nows) == "boottime"  # taken just now
    assert identify_clock(1001 * 10**6, nows) == "boottime"  # a second ahead: still this one
    assert identify_clock(int(1001.5 * 10**6), nows) is None
    assert identify_clock(int((1000 - CLOCK_MATCH_S) * 10**6), nows) == "boottime"
    assert identify_clock(int((1000 - CLOCK_MATCH_S - 1) * 10**6), nows) is None


def test_default_sample_clocks_are_the_three_clocks() -> None:
    clocks = default_sample_clocks(lambda: 42.0)
    assert set(clocks) == {"realtime", "boottime", "monotonic"}
    assert clocks["realtime"]() == 42.0
    assert abs(clocks["monotonic"]() - time.clock_gettime(time.CLOCK_MONOTONIC)) < 5
    assert clocks["boottime"]() >= clocks["monotonic"]() - 5


def test_util_clock_found_or_not_is_logged_once_at_its_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml([gpu(index=0, util_samples=[(int((WALL_NOW - 1) * 1e6), 40)]),
                     gpu(index=1, util_samples=[(12_345_678, 40)])])
    b = backend(fake)
    with caplog.at_level(logging.INFO, logger=NVML_LOGGER):
        b.sample_devices()
        fake.gpus[0]["util_samples"].append((int(WALL_NOW * 1e6), 50))
        b.sample_devices()
    assert messages(caplog, "sample timestamps") == [
        ("INFO", f"GPU 0 ({UUID0}): utilisation sample timestamps are on the realtime clock"),
        ("WARNING", f"GPU 1 ({UUID1}): utilisation sample timestamps fit no known clock; "
                    "fine-grained utilisation samples are not used"),
    ]


def test_gpm_window_trouble_is_logged_once_per_metric_and_gpu(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sm, dram = pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
    fake = FakeNvml([gpu(index=0, gpm={sm: float("nan"), dram: 5.0}),
                     gpu(index=1, gpm={sm: 1.0, dram: 5.0},
                         gpm_metric_errors={dram: pynvml.NVML_ERROR_UNKNOWN})])
    b = NvmlBackend(lib=fake, clock=Clock(), pcie_thread=False,
                    gpm_clock=iter(range(0, 100, 2)).__next__)
    with caplog.at_level(logging.WARNING, logger=NVML_LOGGER):
        for _ in range(3):
            b.sample_gpm()
    assert messages(caplog, "absent for that window") == [
        ("WARNING", f"GPU 0 ({UUID0}): GPM metric sm_util answered nan; absent for that "
                    "window (logged once)"),
        ("WARNING", f"GPU 1 ({UUID1}): GPM metric dram_bw_util failed (Unknown Error); absent "
                    "for that window (logged once)"),
    ]


def test_the_shortest_gpm_window_is_allowed() -> None:
    assert check_gpm_interval(MIN_GPM_INTERVAL_S) == MIN_GPM_INTERVAL_S


def test_mig_edges(caplog: pytest.LogCaptureFixture) -> None:
    sparse = mig_gpu()
    sparse["mig"][1]["slot"] = 3  # MIG devices need not fill the slots in order
    with caplog.at_level(logging.INFO, logger=NVML_LOGGER):
        samples = backend(FakeNvml([sparse])).sample_devices()
    assert [s.gpu.uuid[:12] for s in samples] == [UUID0[:12], "MIG-00000001", "MIG-00000002"]
    assert messages(caplog, "MIG mode") == [(
        "INFO", f"GPU 0 ({UUID0}): MIG mode, 2 MIG device(s) (MIG-00000001-fake-mig-uuid, "
        "MIG-00000002-fake-mig-uuid); utilisation and profiling counters are not available per "
        "MIG device")]
    enable, disable = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE
    pending = mig_gpu()
    pending["mig_mode"] = (disable, enable)  # MIG on after the next reset: not yet
    assert len(backend(FakeNvml([pending])).sample_devices()) == 1
    no_mig = FakeNvml([gpu(not_supported={"nvmlDeviceGetMigMode"})])  # e.g. an A10
    b = backend(no_mig)
    assert len(b.sample_devices()) == 1 and "mig_mode" in b.info()["gpus"][0]["unsupported"]


def test_a_library_without_mig_calls_reports_whole_gpus() -> None:
    class NoMig(FakeNvml):
        def __getattribute__(self, name: str) -> Any:
            if name == "nvmlDeviceGetMigMode":
                raise AttributeError(name)
            return super().__getattribute__(name)

    [s] = backend(NoMig([mig_gpu()])).sample_devices()
    assert s.gpu.uuid == UUID0


def test_process_list_v2_refused_too_is_remembered_under_its_own_name() -> None:
    class NeitherDriver(V2OnlyDriver):
        def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
            self._count("nvmlDeviceGetComputeRunningProcesses_v2")
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    b = backend(NeitherDriver([gpu(compute_processes=[(1, 1)])]))
    [s] = b.sample_devices()
    assert s.process_memory_bytes == {}
    unsupported = b.info()["gpus"][0]["unsupported"]
    assert "compute_processes" in unsupported and "compute_processes_v2" in unsupported


def test_per_link_series_once_dropped_stay_dropped() -> None:
    fake = FakeNvml([gpu(nvlink=links18(10), nvlink_per_link_is_aggregate=True)])
    b = backend(fake)
    assert b.sample_devices()[0].nvlink_links == {}
    fake.gpus[0]["nvlink_per_link_is_aggregate"] = False  # now they would sum up...
    [s] = b.sample_devices()
    assert s.nvlink_links == {}  # ...but a driver that lied once is not trusted again


def test_doctor_comparison_goes_on_past_a_gpu_whose_read_fails() -> None:
    fake = FakeNvml([gpu(index=0, pcie_count=counted(0, 0)), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    fake.fail_next["nvmlDeviceGetPcieThroughput"] = [pynvml.NVML_ERROR_GPU_IS_LOST]
    rows = b.compare_pcie(seconds=0.0, sleep=lambda s: None)
    assert rows[UUID0]["call_tx"] is None and rows[UUID1]["call_tx"] == 1000 * 1024
