"""The NVML adapter's PCIe throughput thread (agent/core/hw/nvml/pcie.py) through the fake
pynvml: reads off the sampling path, staleness, failures, and starting and stopping it."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pynvml
import pytest

from mrc_agent.agent.core.hw.base import HardwareError, SourceUnavailable
from mrc_agent.agent.core.hw.nvml import NvmlBackend
from mrc_agent.agent.core.hw.nvml import pcie as pcie_mod
from mrc_agent.agent.core.hw.nvml.pcie import PcieReader
from mrc_agent.agent.tools.simgpu.nvml import FakeNvml, gpu
from tests.nvml_support import (
    NVML_LOGGER,
    UUID0,
    UUID1,
    FakeClock,
    backend,
    messages,
)


def test_pcie_throughput_comes_from_the_cache_never_from_the_sampling_path() -> None:
    fake = FakeNvml(
        [
            gpu(index=0, pcie={"tx_kb_per_s": 10, "rx_kb_per_s": 20, "replays": 0}),
            gpu(index=1, pcie={"tx_kb_per_s": 30, "rx_kb_per_s": 40, "replays": 0}),
        ]
    )
    b = backend(fake)
    s0, s1 = b.sample_devices()
    # Nothing read yet: absent, not zero.
    assert s0.pcie_tx_bytes_per_second is None and s0.pcie_rx_bytes_per_second is None
    assert s1.pcie_tx_bytes_per_second is None
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0  # the 20 ms call is never made here

    b._pcie.run_round()
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 4  # TX and RX per GPU
    s0, s1 = b.sample_devices()
    assert (s0.pcie_tx_bytes_per_second, s0.pcie_rx_bytes_per_second) == (10 * 1024, 20 * 1024)
    assert (s1.pcie_tx_bytes_per_second, s1.pcie_rx_bytes_per_second) == (30 * 1024, 40 * 1024)

    fake.gpus[0]["pcie"]["tx_kb_per_s"] = 99
    [s0, _] = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second == 10 * 1024  # still the last published value
    b._pcie.run_round()
    [s0, _] = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second == 99 * 1024
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 8  # only the two rounds read it


def test_stale_pcie_values_are_reported_absent_not_repeated() -> None:
    clock = FakeClock()
    fake = FakeNvml([gpu()])
    b = backend(fake, clock=clock, pcie_stale_after=2.0)
    b.sample_devices()
    b._pcie.run_round()
    clock.now += 2.0  # exactly at the limit: still fresh
    [s] = b.sample_devices()
    assert s.pcie_tx_bytes_per_second == 1000 * 1024
    clock.now += 0.001  # the reader stopped publishing (e.g. stuck in NVML)
    [s] = b.sample_devices()
    assert s.pcie_tx_bytes_per_second is None and s.pcie_rx_bytes_per_second is None
    b._pcie.run_round()  # it publishes again
    [s] = b.sample_devices()
    assert s.pcie_rx_bytes_per_second == 2000 * 1024


def test_pcie_not_supported_is_remembered_and_not_read_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml([gpu(index=0, not_supported={"nvmlDeviceGetPcieThroughput"}), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    with caplog.at_level(logging.INFO, logger="mrc_agent.agent.core.hw.nvml"):
        for _ in range(3):
            b._pcie.run_round()
    s0, s1 = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second is None and s0.pcie_rx_bytes_per_second is None
    assert s1.pcie_tx_bytes_per_second == 1000 * 1024  # the other GPU is unaffected
    # GPU 0: its first TX call only, then never again; GPU 1: TX and RX in each of 3 rounds.
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 1 + 3 * 2
    assert len([r for r in caplog.records if "pcie_throughput" in r.getMessage()]) == 1
    # The same memory of unsupported queries as every other field (doctor shows it).
    g0, g1 = b.info()["gpus"]
    assert "pcie_throughput" in g0["unsupported"] and "pcie_throughput" not in g1["unsupported"]


def test_failing_pcie_read_skips_the_gpu_and_does_not_break_sampling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    with caplog.at_level(logging.DEBUG, logger="mrc_agent.agent.core.hw.nvml"):
        for _ in range(2):
            fake.fail_next["nvmlDeviceGetPcieThroughput"] = [pynvml.NVML_ERROR_UNKNOWN]
            b._pcie.run_round()  # GPU 0's first call fails; no exception escapes
    s0, s1 = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second is None  # skipped, never a made-up value
    assert s1.pcie_tx_bytes_per_second == 1000 * 1024
    failures = [r for r in caplog.records if "reading PCIe throughput failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].levelno == logging.DEBUG  # logged once, at debug
    # Neither remembered as unsupported nor a reason to re-initialise NVML.
    assert fake.calls["nvmlInit"] == 1
    b._pcie.run_round()
    s0, _ = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second == 1000 * 1024


def test_pcie_round_tolerates_handles_invalidated_by_a_reinit() -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    snapshot = b._session.snapshot()  # what the thread holds while the sampler re-initialises
    assert snapshot is not None
    fake.lose_gpu(1)
    with pytest.raises(HardwareError):
        b.sample_devices()
    fake.restore_gpu(1)
    b.sample_devices()  # a new session: the snapshot's handles are dead
    assert fake.calls["nvmlInit"] == 2
    lib, old_gpus = snapshot
    b._pcie.read(lib, old_gpus)  # NVMLErrors from dead handles: skipped, not raised
    b._pcie.run_round()  # the next round takes the new session's handles
    s0, s1 = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second == s1.pcie_tx_bytes_per_second == 1000 * 1024


def test_pcie_round_without_an_nvml_session_does_nothing() -> None:
    fake = FakeNvml([gpu()])
    b = backend(fake)
    b._pcie.run_round()  # not initialised yet
    b.sample_devices()
    b.close()
    b._pcie.run_round()  # shut down
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0


def pcie_thread_of(b: NvmlBackend) -> threading.Thread | None:
    return b._pcie.thread


def test_pcie_thread_starts_on_first_successful_sample_and_close_stops_it() -> None:
    fake = FakeNvml([gpu()])
    b = NvmlBackend(lib=fake, pcie_period=0.01)
    assert pcie_thread_of(b) is None  # lazily: nothing before the first sample
    [s] = b.sample_devices()
    thread = pcie_thread_of(b)
    assert thread is not None and thread.is_alive() and thread.daemon
    assert thread.name == "mrc-agent-nvml-pcie"
    b.sample_devices()
    assert pcie_thread_of(b) is thread  # one thread, not one per sample

    deadline = time.monotonic() + 5.0
    while s.pcie_tx_bytes_per_second is None and time.monotonic() < deadline:
        time.sleep(0.01)
        [s] = b.sample_devices()
    assert (s.pcie_tx_bytes_per_second, s.pcie_rx_bytes_per_second) == (1000 * 1024, 2000 * 1024)

    b.close()
    assert not thread.is_alive()
    assert pcie_thread_of(b) is None
    b.close()  # still idempotent


def test_pcie_thread_not_started_when_sampling_fails() -> None:
    b = NvmlBackend(lib=FakeNvml([gpu()], library_missing=True))
    with pytest.raises(SourceUnavailable):
        b.sample_devices()
    assert pcie_thread_of(b) is None


def test_close_interrupts_the_pause_at_once() -> None:
    fake = FakeNvml([gpu()])
    b = NvmlBackend(lib=fake, pcie_period=60.0)
    b.sample_devices()
    thread = pcie_thread_of(b)
    assert thread is not None
    deadline = time.monotonic() + 5.0
    while fake.calls["nvmlDeviceGetPcieThroughput"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # let the first round finish, so the thread is in its 60 s pause
    started = time.monotonic()
    b.close()
    assert time.monotonic() - started < 1.0
    assert not thread.is_alive()


def test_blocking_pcie_reads_do_not_slow_sampling() -> None:
    fake = FakeNvml([gpu(index=i) for i in range(8)])
    fake.pcie_throughput_delay_s = 0.2  # far slower than NVML's 20 ms, to make it obvious
    b = NvmlBackend(lib=fake, pcie_period=0.0)
    b.sample_devices()  # starts the thread, which is now blocked in its reads
    deadline = time.monotonic() + 5.0
    while fake.calls["nvmlDeviceGetPcieThroughput"] < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    started = time.monotonic()
    for _ in range(5):
        b.sample_devices()
    # Had sampling read PCIe itself: 5 samples x 8 GPUs x 2 x 0.2 s = 16 s.
    assert time.monotonic() - started < 1.0
    b.close()


def test_pcie_parameters_are_checked() -> None:
    with pytest.raises(ValueError):
        NvmlBackend(lib=FakeNvml([gpu()]), pcie_period=-1.0)
    with pytest.raises(ValueError):
        NvmlBackend(lib=FakeNvml([gpu()]), pcie_stale_after=0.0)


def test_pcie_parameters_are_checked_with_their_names() -> None:
    with pytest.raises(ValueError, match=r"^pcie_period must be >= 0, not -1.0$"):
        NvmlBackend(lib=FakeNvml([gpu()]), pcie_period=-1.0)
    with pytest.raises(ValueError, match=r"^pcie_stale_after must be > 0, not 0.0$"):
        NvmlBackend(lib=FakeNvml([gpu()]), pcie_stale_after=0.0)
    NvmlBackend(lib=FakeNvml([gpu()]), pcie_period=0.0, pcie_stale_after=0.5)  # both allowed


def test_pcie_reader_defaults_start_a_thread_and_keep_values_five_seconds() -> None:
    clock = FakeClock()
    b = backend(FakeNvml([gpu()]))
    b.sample_devices()
    reader = PcieReader(b._session, b._memo, clock)
    reader.run_round()
    clock.now += 5.0
    assert reader.latest(UUID0) is not None
    clock.now += 0.001
    assert reader.latest(UUID0) is None
    reader.start()
    thread = reader.thread
    assert thread is not None and thread.is_alive()
    reader.stop()
    assert not thread.is_alive()


def test_pcie_round_told_to_stop_reads_nothing() -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    stop = threading.Event()
    stop.set()
    b._pcie.run_round(stop)
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0
    b._pcie.run_round(threading.Event())
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 4


def test_pcie_value_dropped_as_soon_as_the_gpu_stops_supporting_it() -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    b._pcie.run_round()
    fake.gpus[0]["not_supported"].add("nvmlDeviceGetPcieThroughput")
    b._pcie.run_round()
    s0, s1 = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second is None  # not the last value until it goes stale
    assert s1.pcie_tx_bytes_per_second == 1000 * 1024


def test_failing_pcie_reads_are_logged_once_per_gpu_with_the_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    with caplog.at_level(logging.DEBUG, logger=NVML_LOGGER):
        for _ in range(2):
            fake.fail_next["nvmlDeviceGetPcieThroughput"] = [pynvml.NVML_ERROR_UNKNOWN] * 2
            b._pcie.run_round()
    assert messages(caplog, "reading PCIe throughput failed") == [
        f"GPU 0 ({UUID0}): reading PCIe throughput failed (Unknown Error); skipped this round",
        f"GPU 1 ({UUID1}): reading PCIe throughput failed (Unknown Error); skipped this round",
    ]


def test_pcie_thread_survives_failing_rounds_and_logs_each_kind_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml([gpu()])
    failures: list[Exception] = [RuntimeError("boom"), RuntimeError("again"), ValueError("bad")]
    read = fake.nvmlDeviceGetPcieThroughput

    def flaky(handle: Any, counter: int) -> int:
        if failures:
            raise failures.pop(0)  # a bug, not an NVMLError: the round fails as a whole
        return read(handle, counter)

    fake.nvmlDeviceGetPcieThroughput = flaky  # type: ignore[method-assign]
    b = NvmlBackend(lib=fake, pcie_period=0.01)
    with caplog.at_level(logging.WARNING, logger=NVML_LOGGER):
        [s] = b.sample_devices()
        deadline = time.monotonic() + 5.0
        while s.pcie_tx_bytes_per_second is None and time.monotonic() < deadline:
            time.sleep(0.01)
            [s] = b.sample_devices()
        b.close()
    assert s.pcie_tx_bytes_per_second == 1000 * 1024  # the fourth round, after a pause each
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "PCIe throughput round failed: RuntimeError('boom')"),
        (logging.WARNING, "PCIe throughput round failed: ValueError('bad')"),
    ]


class GatedPcieRead:
    """Replaces the fake's PCIe read: the first call blocks until ``gate`` is set, as a 20 ms
    NVML window (or a hung call) would, and tells the test through ``entered``."""

    def __init__(self, fake: FakeNvml) -> None:
        self._read = fake.nvmlDeviceGetPcieThroughput
        self.entered = threading.Event()
        self.gate = threading.Event()
        fake.nvmlDeviceGetPcieThroughput = self  # type: ignore[method-assign]

    def __call__(self, handle: Any, counter: int) -> int:
        if not self.entered.is_set():
            self.entered.set()
            self.gate.wait(5.0)
        return self._read(handle, counter)


def test_stopping_ends_a_round_after_the_gpu_being_read() -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    read = GatedPcieRead(fake)
    b = NvmlBackend(lib=fake, pcie_period=60.0)
    b.sample_devices()
    assert read.entered.wait(5.0)  # the thread is in GPU 0's TX read
    opener = threading.Timer(0.01, read.gate.set)  # the read returns while close() waits
    opener.start()
    b.close()
    opener.join()
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 2  # GPU 0's TX and RX, not GPU 1


def test_close_gives_up_on_a_hung_pcie_read_with_a_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    timeout = 0.05
    monkeypatch.setattr(pcie_mod, "PCIE_JOIN_TIMEOUT_S", timeout)
    fake = FakeNvml([gpu()])
    read = GatedPcieRead(fake)
    b = NvmlBackend(lib=fake, pcie_period=60.0)
    b.sample_devices()
    thread = pcie_thread_of(b)
    assert thread is not None
    assert read.entered.wait(5.0)  # hung in an NVML call
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=NVML_LOGGER):
        b.close()
    assert time.monotonic() - started < 1.0  # waited the join timeout, not for the call
    assert thread.is_alive() and not fake.initialized  # shut down anyway
    assert messages(caplog, "still in an NVML call") == [
        f"PCIe throughput thread still in an NVML call after {timeout:.1f} s; "
        "shutting NVML down anyway"
    ]
    read.gate.set()  # its call returns, it sees the stop and ends
    thread.join(5.0)
    assert not thread.is_alive()


def test_pcie_thread_starts_again_after_close() -> None:
    fake = FakeNvml([gpu()])
    b = NvmlBackend(lib=fake, pcie_period=0.01)
    b.sample_devices()
    first = pcie_thread_of(b)
    b.close()
    b.sample_devices()
    second = pcie_thread_of(b)
    assert second is not None and second is not first and second.is_alive()
    b.close()
    assert first is not None and not first.is_alive() and not second.is_alive()


def _hold_session_lock(b: NvmlBackend) -> tuple[threading.Event, threading.Thread]:
    """A sampler pass that holds the session lock until the returned event is set."""
    held, release = threading.Event(), threading.Event()

    def a_long_pass() -> None:
        with b._session.lock:
            held.set()
            release.wait(10.0)

    sampler = threading.Thread(target=a_long_pass, daemon=True)
    sampler.start()
    assert held.wait(5.0)
    return release, sampler


def test_a_narrow_round_does_not_wait_for_a_pass_holding_the_session_lock() -> None:
    fake = FakeNvml([gpu(pcie_count={"tx_bytes": 0, "rx_bytes": 0,
                                     "value_type": "NVML_VALUE_TYPE_UNSIGNED_INT"})])
    b = backend(fake)
    b.sample_devices()
    release, sampler = _hold_session_lock(b)
    try:
        before = fake.calls["nvmlDeviceGetFieldValues"]
        reader = threading.Thread(target=b._narrow.run_round, daemon=True)
        reader.start()
        reader.join(5.0)
        # Before, the round's snapshot waited for the lock: alive, nothing read.
        assert not reader.is_alive()
        assert fake.calls["nvmlDeviceGetFieldValues"] == before + 1
    finally:
        release.set()
        sampler.join(5.0)


def test_the_narrow_thread_reads_on_through_a_200_ms_pass() -> None:
    fake = FakeNvml([gpu(pcie_count={"tx_bytes": 0, "rx_bytes": 0,
                                     "value_type": "NVML_VALUE_TYPE_UNSIGNED_INT"})])
    b = NvmlBackend(lib=fake)  # the real thread, every ~22 ms
    try:
        b.sample_devices()
        assert b._narrow.thread is not None
        release, sampler = _hold_session_lock(b)
        before = fake.calls["nvmlDeviceGetFieldValues"]
        time.sleep(0.2)
        during = fake.calls["nvmlDeviceGetFieldValues"] - before
        release.set()
        sampler.join(5.0)
    finally:
        b.close()
    # ~9 at its pace; 2 leaves a wide margin on a loaded machine. Before: 0, or 1 in flight.
    assert during >= 2
