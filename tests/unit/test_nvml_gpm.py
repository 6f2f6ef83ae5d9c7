"""The NVML adapter's GPM sampling (agent/core/hw/nvml/gpm.py) through the fake pynvml: windows,
conversions, unsupported metrics and GPUs, errors and recovery."""
from __future__ import annotations

import logging
from typing import Any

import pynvml
import pytest

from mrc_agent.agent.core.hw.base import SourceUnavailable
from mrc_agent.agent.core.hw.nvml import NvmlBackend
from mrc_agent.agent.tools.simgpu.nvml import gpu
from tests.nvml_support import (
    NVML_LOGGER,
    UUID0,
    UUID1,
    EventNvml,
    FakeClock,
    backend,
    gpm_values,
    messages,
)


def _refused_twice(b: NvmlBackend) -> None:
    """``b`` refuses GPM as unsupported, and again on the next pass: the verdict sticks (the
    caller asserts how few NVML calls it took)."""
    for _ in range(2):
        with pytest.raises(SourceUnavailable) as info:
            b.sample_gpm()
        assert info.value.reason == "gpm_unsupported"


def _logged_over_passes(b: NvmlBackend, caplog: pytest.LogCaptureFixture, about: str) -> list[str]:
    """The adapter's messages containing ``about`` over three GPM passes: what is logged once
    shows once, not once a pass."""
    with caplog.at_level(logging.INFO, logger=NVML_LOGGER):
        for _ in range(3):
            b.sample_gpm()
    return messages(caplog, about)


def test_gpm_first_call_primes_then_reports_converted_values() -> None:
    fake = EventNvml([gpu(gpm=gpm_values())])
    b = backend(fake)
    assert b.sample_gpm() == []
    [g] = b.sample_gpm()
    assert g.gpu.uuid == "GPU-00000000-fake-uuid"
    assert g.sm_util == pytest.approx(0.80)
    assert g.sm_occupancy == pytest.approx(0.40)
    assert g.tensor_util == pytest.approx(0.25)
    assert g.dram_bw_util == pytest.approx(0.50)
    assert g.pcie_tx_bytes_per_second == 100 * 2**20
    assert g.pcie_rx_bytes_per_second == 200 * 2**20
    assert g.nvlink_tx_bytes_per_second == 3 * 2**20
    assert g.nvlink_rx_bytes_per_second == 4 * 2**20

    fake.gpus[0]["gpm"] = gpm_values(SM_UTIL=10.0)
    [g] = b.sample_gpm()
    assert g.sm_util == pytest.approx(0.10)
    assert fake.calls["nvmlGpmSampleAlloc"] == 2  # two buffers, reused alternately


def test_gpm_metric_not_supported_is_absent_not_zero() -> None:
    values = gpm_values()
    del values[pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC]
    del values[pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC]
    fake = EventNvml([gpu(gpm=values)])
    b = backend(fake)
    b.sample_gpm()
    [g] = b.sample_gpm()
    assert g.nvlink_tx_bytes_per_second is None and g.nvlink_rx_bytes_per_second is None
    assert g.sm_util == pytest.approx(0.80)


def test_gpm_only_for_capable_gpus() -> None:
    fake = EventNvml([gpu(index=0, gpm=None), gpu(index=1, gpm=gpm_values())])
    b = backend(fake)
    b.sample_gpm()
    samples = b.sample_gpm()
    assert [g.gpu.index for g in samples] == [1]


def test_gpm_unsupported_everywhere_is_source_unavailable() -> None:
    fake = EventNvml([gpu(index=0), gpu(index=1)])  # gpm=None: pre-Hopper
    _refused_twice(backend(fake))
    assert fake.calls["nvmlGpmQueryDeviceSupport"] == 2  # once per GPU, then remembered


def test_gpm_metrics_are_computed_between_consecutive_samples() -> None:
    fake = EventNvml([gpu(gpm=gpm_values())])
    b = backend(fake)
    for _ in range(4):
        b.sample_gpm()
    # Sample n+1 is taken into the buffer that held sample n-1: each window is the last period.
    assert fake.gpm_windows == [(1, 2), (2, 3), (3, 4)]


def test_gpus_without_gpm_are_each_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    fake = EventNvml(
        [
            gpu(index=0),
            gpu(index=1, not_supported={"nvmlGpmQueryDeviceSupport"}),
            gpu(index=2, gpm=gpm_values()),
        ]
    )
    b = backend(fake)
    assert _logged_over_passes(b, caplog, "GPM support") == [
        f"GPU 0 ({UUID0}): no GPM support",
        f"GPU 1 ({UUID1}): no GPM support",
    ]
    g0, g1, g2 = b.info()["gpus"]
    assert (g0["gpm_supported"], g1["gpm_supported"], g2["gpm_supported"]) == (False, False, True)
    assert g1["unsupported"] == ["gpm"] and g0["unsupported"] == []


def test_gpm_supported_device_that_will_not_sample_is_unsupported_at_once() -> None:
    # E.g. MIG mode at device level: the support query says yes, sampling says NOT_SUPPORTED.
    fake = EventNvml([gpu(gpm=gpm_values(), not_supported={"nvmlGpmSampleGet"})])
    b = backend(fake)
    _refused_twice(b)
    assert fake.calls["nvmlGpmSampleGet"] == 1
    [g] = b.info()["gpus"]
    assert g["gpm_supported"] is False and g["unsupported"] == ["gpm"]


def test_gpm_metrics_not_supported_are_each_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    values = gpm_values()
    del values[pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC]
    del values[pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC]
    b = backend(EventNvml([gpu(gpm=values)]))
    assert _logged_over_passes(b, caplog, "GPM metric") == [
        f"GPU 0 ({UUID0}): GPM metric nvlink_tx_bytes_per_second not supported; leaving it absent",
        f"GPU 0 ({UUID0}): GPM metric nvlink_rx_bytes_per_second not supported; leaving it absent",
    ]


def test_gpm_metric_error_is_absent_for_that_window_not_a_session_reset(
    caplog: pytest.LogCaptureFixture,
) -> None:
    unknown = pynvml.NVML_ERROR_UNKNOWN
    fake = EventNvml(
        [gpu(gpm=gpm_values(), gpm_metric_errors={pynvml.NVML_GPM_METRIC_SM_UTIL: unknown})]
    )
    b = backend(fake)
    b.sample_gpm()
    with caplog.at_level(logging.WARNING, logger=NVML_LOGGER):
        [g] = b.sample_gpm()
        [g] = b.sample_gpm()
    assert g.sm_util is None  # the failing metric is absent...
    assert g.dram_bw_util == pytest.approx(0.50)  # ...the others are there
    assert fake.calls["nvmlInit"] == 1 and fake.calls["nvmlShutdown"] == 0  # no re-init
    assert len(messages(caplog, "absent for that window")) == 1  # logged once, not per window
    fake.gpus[0]["gpm_metric_errors"] = {}
    [g] = b.sample_gpm()
    assert g.sm_util == pytest.approx(0.80)  # back in the next window


def test_gpm_nan_and_infinite_values_are_dropped_and_ratios_clamped() -> None:
    fake = EventNvml([gpu(gpm=gpm_values(SM_UTIL=float("nan"), SM_OCCUPANCY=100.4,
                                        ANY_TENSOR_UTIL=-0.2, PCIE_TX_PER_SEC=float("inf"),
                                        PCIE_RX_PER_SEC=-1.0))])
    b = backend(fake)
    b.sample_gpm()
    [g] = b.sample_gpm()
    assert g.sm_util is None  # NaN with SUCCESS: absent, never exported
    assert g.sm_occupancy == 1.0 and g.tensor_util == 0.0  # clamped to 0-1
    assert g.pcie_tx_bytes_per_second is None  # infinite: absent
    assert g.pcie_rx_bytes_per_second == 0.0  # a rate is never negative
    assert g.dram_bw_util == pytest.approx(0.50)


def test_gpm_samples_once_per_window_and_repeats_the_last_window_between() -> None:
    clock = FakeClock()
    fake = EventNvml([gpu(gpm=gpm_values())])
    b = backend(fake, gpm_clock=clock, gpm_interval=1.0)
    assert b.sample_gpm() == []  # primes at t=0
    clock.now += 0.5
    assert b.sample_gpm() == []  # inside the first window: nothing yet, no new sample
    assert fake.calls["nvmlGpmSampleGet"] == 1
    clock.now += 0.5
    [g] = b.sample_gpm()  # the window closed at t=1.0
    assert g.sm_util == pytest.approx(0.80)
    fake.gpus[0]["gpm"] = gpm_values(SM_UTIL=10.0)
    for _ in range(5):  # a 10 Hz sampler inside the second window
        clock.now += 0.1
        [g] = b.sample_gpm()
        assert g.sm_util == pytest.approx(0.80)  # the last window's value, again
    assert fake.calls["nvmlGpmSampleGet"] == 2 and fake.calls["nvmlGpmMetricsGet"] == 1
    clock.now += 0.5
    [g] = b.sample_gpm()
    assert g.sm_util == pytest.approx(0.10)
    assert fake.gpm_windows == [(1, 2), (2, 3)]


@pytest.mark.parametrize("seconds", [0.0, 0.1, 0.19, float("nan"), float("inf") * -1])
def test_gpm_interval_under_the_floor_is_refused(seconds: float) -> None:
    with pytest.raises(ValueError, match="at least 0.2 s"):
        backend(EventNvml([gpu()]), gpm_interval=seconds)


def test_gpm_buffer_that_cannot_be_freed_does_not_stop_teardown(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = EventNvml([gpu(gpm=gpm_values())])
    b = backend(fake)
    b.sample_devices()
    b.sample_gpm()

    def refuse(sample: Any) -> None:
        fake.calls["nvmlGpmSampleFree"] += 1
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(fake, "nvmlGpmSampleFree", refuse)
    with caplog.at_level(logging.DEBUG, logger=NVML_LOGGER):
        b.close()
    assert fake.calls["nvmlGpmSampleFree"] == 2  # both buffers tried
    assert all(e.freed for e in fake.event_sets) and not fake.initialized
    assert messages(caplog, "freeing") == [
        "ignored NVML error while freeing a GPM sample: Unknown Error"
    ] * 2
