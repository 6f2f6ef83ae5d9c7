"""PCIe byte counters that cannot silently under-read.

A 32-bit byte counter wraps every ~67 ms of a Gen5 x16 link. The agent takes each counter as
32 bits wide until it has seen a value of 2^32 or more on it, whatever NVML value type it comes
as, reads a narrow one from a thread of its own often enough that no wrap goes unseen, and
drops (says once, and counts in mrc_gpu_pcie_dropped_intervals_total) any increase the link
cannot explain: a narrow counter read too late, or a jump larger than the link carries.
"""

from __future__ import annotations

import logging
import threading

import pynvml
import pytest

from mrc_agent.agent.core.attribution import MODE_ALL
from mrc_agent.agent.core.collectors.gpu import PCIE_DROPPED, GpuCollector
from mrc_agent.agent.core.hw.nvml import NvmlBackend
from mrc_agent.agent.core.hw.nvml.pcie_counters import (
    FALLBACK_LINK_BYTES_PER_S,
    NARROW_THREAD_NAME,
    link_bytes_per_s,
    narrow_period,
    unwrap,
)
from mrc_agent.agent.tools.simgpu.nvml import FakeNvml, gpu
from tests.nvml_support import NVML_LOGGER as LOGGER
from tests.nvml_support import UUID0, backend, counted
from tests.nvml_support import FakeClock as Clock
from tests.support import pass_view

U32 = "NVML_VALUE_TYPE_UNSIGNED_INT"
U64 = "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG"
#: Host->device copies on an H200, bytes per second: a 32-bit counter wraps every 81 ms.
RATE = 53e9


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_the_link_bounds_the_counter_and_sets_the_narrow_period() -> None:
    assert link_bytes_per_s(5, 16) == 64e9  # an H200's Gen5 x16
    assert link_bytes_per_s(4, 8) == 16e9
    assert link_bytes_per_s(None, 16) == FALLBACK_LINK_BYTES_PER_S == 128e9
    assert link_bytes_per_s(5, 0) == FALLBACK_LINK_BYTES_PER_S
    assert link_bytes_per_s(99, 16) == FALLBACK_LINK_BYTES_PER_S
    # Three reads per the 67 ms a Gen5 x16 link needs to wrap 2^32 bytes.
    assert narrow_period(32, 64e9) == pytest.approx(2**32 / 64e9 / 3)
    assert narrow_period(32, 1e6) == 0.25  # a slow link is still read four times a second
    assert narrow_period(8, 128e9) == 0.005  # never faster than the floor


def test_unwrap_drops_what_the_link_cannot_explain() -> None:
    # Within the window one wrap is certain; past it any number of wraps could hide.
    assert unwrap(2**32 - 100, 50, 32, 0.05, 64e9) == 150
    assert unwrap(2**32 - 100, 50, 32, 0.07, 64e9) is None
    assert unwrap(100, 200, 32, 0.07, 64e9) is None  # even an increase: it may hide a wrap
    # A 64-bit counter's jump beyond the link in the time is impossible, not traffic.
    assert unwrap(0, 65e9 + 2**21, 64, 1.0, 64e9) is None
    assert unwrap(0, 63e9, 64, 1.0, 64e9) == 63e9
    # A decrease no wrap explains is a restart counted from zero, if the link allows it.
    assert unwrap(10e9, 5e9, 64, 1.0, 64e9) == 5e9
    assert unwrap(100e9, 90e9, 64, 1.0, 64e9) is None


def test_the_narrow_thread_keeps_a_32_bit_total_right_across_a_dozen_wraps() -> None:
    clock = Clock()
    fake = FakeNvml([gpu(pcie_count=counted(0, 0, U32))])
    b = backend(fake, clock=clock)
    b.sample_devices()
    assert b._pcie_counters.narrow(UUID0)
    assert b._pcie_counters.narrow_period() == pytest.approx(2**32 / 64e9 / 3)
    true = 0.0
    for _ in range(50):  # one second, read every 20 ms as the thread does
        clock.now += 0.02
        true += RATE * 0.02
        fake.gpus[0]["pcie_count"] = counted(true, true / 2, U32)
        b._narrow.run_round()
    [s] = b.sample_devices()
    assert true > 12 * 2**32
    assert s.pcie_tx_bytes_total == int(true) and s.pcie_rx_bytes_total == int(true / 2)
    assert s.pcie_tx_bytes_per_second == pytest.approx(RATE, rel=1e-6)
    assert s.pcie_rx_bytes_per_second == pytest.approx(RATE / 2, rel=1e-6)


def test_a_narrow_counter_read_too_late_is_dropped_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    fake = FakeNvml([gpu(pcie_count=counted(0, 0, U32))])
    b = backend(fake, clock=clock)
    true = 0.0
    with caplog.at_level(logging.INFO, logger=LOGGER):
        b.sample_devices()
        for _ in range(2):  # a second each with no thread: the wraps cannot be counted
            clock.now += 1.0
            true += RATE
            fake.gpus[0]["pcie_count"] = counted(true, true, U32)
            [s] = b.sample_devices()
            assert s.pcie_tx_bytes_total == 0.0  # not the 1/13 of the truth one wrap gives
            assert s.pcie_tx_bytes_per_second is None
        # The thread reads again: the totals go on from there, the next rate is known.
        for _ in range(10):
            clock.now += 0.02
            true += RATE * 0.02
            fake.gpus[0]["pcie_count"] = counted(true, true, U32)
            b._narrow.run_round()
        [s] = b.sample_devices()
    assert s.pcie_tx_bytes_total == pytest.approx(RATE * 0.2, abs=1)
    assert s.pcie_tx_bytes_per_second == pytest.approx(RATE, rel=1e-6)
    [said] = warnings_of(caplog)
    assert said.startswith(f"GPU 0 ({UUID0}): PCIe TX byte counter went from 0 to ")
    assert "a 32-bit counter on a 64 GB/s link cannot be read from unambiguously" in said
    assert [r.getMessage() for r in caplog.records if "read every" in r.getMessage()] == [
        f"GPU 0 ({UUID0}): PCIe byte counters are taken as 32-bit (none seen at 2^32 yet) and "
        "wrap every 67 ms at the link's 64 GB/s; read every 22 ms by their own thread"]


def test_an_impossible_jump_of_a_64_bit_counter_is_dropped_not_exported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    fake = FakeNvml([gpu(pcie_count=counted(1_000, 1_000, U64))])
    b = backend(fake, clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        b.sample_devices()
        clock.now += 1.0
        fake.gpus[0]["pcie_count"] = counted(1_000 + 5e9, 1_000 + 2**60, U64)
        [s] = b.sample_devices()
    assert s.pcie_tx_bytes_total == 5e9 and s.pcie_tx_bytes_per_second is None
    assert s.pcie_rx_bytes_total == 0.0  # 2^60 bytes in a second: dropped
    assert len(warnings_of(caplog)) == 1
    assert not b._pcie_counters.narrow(UUID0) and b._pcie_counters.narrow_period() is None


def test_without_the_link_from_nvml_the_fastest_link_bounds_it() -> None:
    clock = Clock()
    fake = FakeNvml([gpu(pcie={"tx_kb_per_s": 0, "rx_kb_per_s": 0, "replays": 0},
                         pcie_count=counted(0, 0, U32))])
    b = backend(fake, clock=clock)
    b.sample_devices()
    assert b._pcie_counters.narrow_period() == pytest.approx(2**32 / 128e9 / 3)
    assert fake.calls["nvmlDeviceGetMaxPcieLinkGeneration"] == 1
    b.sample_devices()
    assert fake.calls["nvmlDeviceGetMaxPcieLinkGeneration"] == 1  # asked once per GPU


def test_the_thread_runs_for_narrow_counters_only_and_stops_at_close() -> None:
    wide = NvmlBackend(lib=FakeNvml([gpu(pcie_count=counted(2**40, 2**40, U64))]))
    narrow_fake = FakeNvml([gpu(pcie_count=counted(0, 0, U32))])
    narrow = NvmlBackend(lib=narrow_fake)
    try:
        wide.sample_devices()
        assert wide._narrow.thread is None
        narrow.sample_devices()
        thread = narrow._narrow.thread
        assert thread is not None and thread.name == NARROW_THREAD_NAME and thread.is_alive()
        assert NARROW_THREAD_NAME in {t.name for t in threading.enumerate()}
    finally:
        wide.close()
        narrow.close()
    assert not thread.is_alive()
    calls = narrow_fake.calls["nvmlDeviceGetFieldValues"]
    assert calls >= 2  # the sampler's read and at least one of the thread's


def test_the_agent_reads_an_h200_like_32_bit_counter_right_at_its_cadences() -> None:
    from mrc_agent.agent.tools.selfcheck import command as selfcheck
    from mrc_agent.agent.tools.selfcheck import compare as cmp
    from mrc_agent.agent.tools.selfcheck.dry import DryModel, DryWorkload
    from mrc_agent.agent.tools.selfcheck.dry_device import DryNvml
    from mrc_agent.agent.tools.selfcheck.pcie import pcie_cadence_checks

    model = DryModel(gpus=1)
    checks, _ = pcie_cadence_checks(
        DryWorkload(model), lambda: selfcheck.nvml_backend(DryNvml(model), 0.2),
        lambda: DryNvml(model), model.uuid(0), 1.2, 1.2, 0.3, 0.3, lambda _msg: None)
    rows = {c.name: c for c in checks if c.name.endswith("rx_counter")}
    assert len(rows) == 3
    for row in rows.values():
        assert row.extra["counter_bits"] == 32
        # Before the narrow thread, each of these read about a tenth of the bytes and FAILED.
        assert row.verdict == cmp.PASS, row


def test_an_unknown_value_type_is_no_attribute_error_on_either_library() -> None:
    from mrc_agent.agent.core.hw.base import HardwareError
    from mrc_agent.agent.core.hw.nvml.session import union_value
    from tests.unit.test_nvml_truth import _load_old_pynvml

    for lib in (pynvml, _load_old_pynvml()):
        value = lib.c_nvmlValue_t()
        value.uiVal = 7
        assert union_value(lib, lib.NVML_VALUE_TYPE_UNSIGNED_INT, value) == 7.0
        # 6 is UNSIGNED_SHORT in 13.x; 12.535 has no name for it.
        with pytest.raises(HardwareError, match="unknown value type 99"):
            union_value(lib, 99, value)
    old = _load_old_pynvml()
    assert not hasattr(old, "NVML_VALUE_TYPE_UNSIGNED_SHORT")
    with pytest.raises(HardwareError, match="unknown value type 6"):
        union_value(old, 6, old.c_nvmlValue_t())


@pytest.mark.parametrize(("member", "value_type", "stored", "want"), [
    ("uiVal", "NVML_VALUE_TYPE_UNSIGNED_INT", 2**32 - 1, 2**32 - 1),
    ("ullVal", "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 2**40, 2**40),
    ("siVal", "NVML_VALUE_TYPE_SIGNED_INT", -1, 2**32 - 1),
    ("sllVal", "NVML_VALUE_TYPE_SIGNED_LONG_LONG", -1, 2**32 - 1),  # an int sign-extended
    ("sllVal", "NVML_VALUE_TYPE_SIGNED_LONG_LONG", -(2**40), 2**64 - 2**40),
    ("dVal", "NVML_VALUE_TYPE_DOUBLE", 5, 5),
])
def test_the_vocabulary_reads_each_value_type_as_looking_it_up_each_time_did(
        member: str, value_type: str, stored: int, want: int) -> None:
    # The thread reads from a table made once per library; it must say what union_value and
    # the sign rules said when they asked the library on every read.
    from mrc_agent.agent.core.hw.base import HardwareError
    from mrc_agent.agent.core.hw.nvml.pcie_counters import Vocabulary, counter_raw
    from mrc_agent.agent.core.hw.nvml.session import union_value

    vocabulary = Vocabulary.of(pynvml)
    assert vocabulary.fields == (pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
                                 pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES)
    value = pynvml.c_nvmlValue_t()
    setattr(value, member, stored)
    code = getattr(pynvml, value_type)
    assert vocabulary.raw(code, value) == counter_raw(pynvml, code, value) == float(want)
    if stored >= 0:
        assert vocabulary.raw(code, value) == union_value(pynvml, code, value)
    with pytest.raises(HardwareError, match="unknown value type 99"):
        vocabulary.raw(99, value)


def test_totals_stay_right_when_the_thread_and_the_sampler_take_turns() -> None:
    # The thread updates a counter in place; the sampler reads what both reads added.
    clock = Clock()
    fake = FakeNvml([gpu(pcie_count=counted(0, 0, U32))])
    b = backend(fake, clock=clock)
    b.sample_devices()
    lib, [g] = b._session.snapshot() or (None, [])
    clock.now += 0.02
    fake.gpus[0]["pcie_count"] = counted(1000, 500, U32)
    first = b._pcie_counters.read(lib, g)
    clock.now += 0.02
    fake.gpus[0]["pcie_count"] = counted(3000, 1500, U32)
    b._narrow.run_round()
    assert first is not None and first[:2] == (1000, 500)
    second = b._pcie_counters.read(lib, g)
    assert second is not None and second[:2] == (3000, 1500)


def _narrow_run(value_type: str, cast: int = 0) -> tuple[float, float, float]:
    """A second of host->device copies at :data:`RATE` on a counter the driver keeps in 32
    bits that NVML hands back as ``value_type``, read every 20 ms by the narrow thread's
    rounds. ``cast``: a negative 32-bit value comes back sign-extended to 64 bits this way
    (the fake stores it in ``ullVal``). (true bytes, TX total, RX total)."""
    def kept(n: float) -> int:
        low = int(n) % 2**32
        return low - 2**32 + cast if cast and low >= 2**31 else low

    clock = Clock()
    fake = FakeNvml([gpu(pcie_count=counted(0, 0, value_type))])
    b = backend(fake, clock=clock)
    b.sample_devices()
    assert b._pcie_counters.narrow(UUID0)  # below 2^32 so far: taken as 32 bits wide
    true = 0.0
    for _ in range(50):
        clock.now += 0.02
        true += RATE * 0.02
        fake.gpus[0]["pcie_count"] = counted(kept(true), kept(true / 2), value_type)
        b._narrow.run_round()
    [s] = b.sample_devices()
    assert s.pcie_tx_bytes_total is not None and s.pcie_rx_bytes_total is not None
    return true, s.pcie_tx_bytes_total, s.pcie_rx_bytes_total


def test_a_32_bit_counter_nvml_types_as_64_bit_wraps_and_is_counted_right() -> None:
    # Before: typed 64-bit, no thread read it and each wrap looked like a restart.
    true, tx, rx = _narrow_run(U64)
    assert true > 12 * 2**32
    assert (tx, rx) == (int(true), int(true / 2))


@pytest.mark.parametrize(("value_type", "cast"), [
    ("NVML_VALUE_TYPE_SIGNED_INT", 0),  # past 2^31 the int reads negative
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", 0),
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", 2**64),  # an int sign-extended to a long long
])
def test_a_32_bit_counter_in_a_signed_type_is_counted_right(value_type: str, cast: int) -> None:
    true, tx, rx = _narrow_run(value_type, cast)
    assert (tx, rx) == (int(true), int(true / 2))


def test_a_counter_seen_at_2_32_or_more_is_wide_from_then_on() -> None:
    clock = Clock()
    fake = FakeNvml([gpu(pcie_count=counted(2**32 - 10, 5, U64))])
    b = backend(fake, clock=clock)
    b.sample_devices()
    assert b._pcie_counters.narrow(UUID0)
    clock.now += 0.01
    fake.gpus[0]["pcie_count"] = counted(2**32 + 90, 5, U64)  # past 2^32: 64 bits wide
    b.sample_devices()
    assert b._pcie_counters.narrow(UUID0)  # RX not yet
    clock.now += 1.0
    fake.gpus[0]["pcie_count"] = counted(2**32 + 1e9, 2**33, U64)
    [s] = b.sample_devices()
    assert not b._pcie_counters.narrow(UUID0) and b._pcie_counters.narrow_period() is None
    assert s.pcie_tx_bytes_total == 100 + 1e9 - 90  # a second apart, and kept: 64 bits
    assert s.pcie_rx_bytes_total == 2**33 - 5


def _dropped(b: NvmlBackend) -> dict[tuple[str, str], float]:
    """``mrc_gpu_pcie_dropped_intervals_total`` as the gpu collector emits it, by
    (direction, reason)."""
    out = GpuCollector(b, MODE_ALL).update(pass_view()).samples
    return {labels[-2:]: value for name, labels, value in out  # type: ignore[misc]
            if name == PCIE_DROPPED.name}


def test_every_dropped_interval_is_counted_by_direction_and_reason() -> None:
    clock = Clock()
    fake = FakeNvml([gpu(pcie_count=counted(0, 0, U32))])
    b = backend(fake, clock=clock)
    zero = {(d, r): 0.0 for d in ("tx", "rx") for r in ("gap", "impossible")}
    assert _dropped(b) == zero  # every series from the first read, at 0
    true = 0.0
    for n in (1, 2):  # the narrow thread stopped: reads a second apart, twice
        clock.now += 1.0
        true += RATE
        fake.gpus[0]["pcie_count"] = counted(true, true, U32)
        assert _dropped(b) == zero | {("tx", "gap"): n, ("rx", "gap"): n}
    clock.now += 0.02  # the thread's pace again: nothing more is dropped
    fake.gpus[0]["pcie_count"] = counted(true + RATE * 0.02, true + RATE * 0.02, U32)
    assert _dropped(b)[("tx", "gap")] == 2


def test_an_impossible_jump_is_counted_apart_from_a_gap() -> None:
    clock = Clock()
    fake = FakeNvml([gpu(pcie_count=counted(2**40, 2**40, U64))])
    b = backend(fake, clock=clock)
    b.sample_devices()
    clock.now += 1.0
    fake.gpus[0]["pcie_count"] = counted(2**40 + 5e9, 2**40 + 2**60, U64)
    [s] = b.sample_devices()
    assert s.pcie_dropped_intervals[("rx", "impossible")] == 1
    assert sum(s.pcie_dropped_intervals.values()) == 1


def test_the_throughput_call_gpu_has_no_dropped_series() -> None:
    assert _dropped(backend(FakeNvml([gpu()]))) == {}


def test_the_link_bound_takes_the_device_max_generation_and_16_lanes() -> None:
    # A VM that says Gen3 x4 of an H200 (Gen5 x16): 4 GB/s would make real traffic impossible.
    link = {"tx_kb_per_s": 0, "rx_kb_per_s": 0, "replays": 0, "max_link_generation": 3,
            "max_link_width": 4, "gpu_max_link_generation": 5}
    clock = Clock()
    fake = FakeNvml([gpu(pcie=link, pcie_count=counted(0, 0, U32))])
    b = backend(fake, clock=clock)
    b.sample_devices()
    assert b._pcie_counters.narrow_period() == pytest.approx(2**32 / 64e9 / 3)
    clock.now += 0.02
    fake.gpus[0]["pcie_count"] = counted(RATE * 0.02, 0, U32)  # 53 GB/s, 20 ms apart
    [s] = b.sample_devices()
    assert s.pcie_tx_bytes_total == int(RATE * 0.02)
    assert sum(s.pcie_dropped_intervals.values()) == 0
    assert fake.calls["nvmlDeviceGetGpuMaxPcieLinkGeneration"] == 1


def test_without_the_device_max_generation_the_reported_one_at_16_lanes_bounds_it() -> None:
    link = {"tx_kb_per_s": 0, "rx_kb_per_s": 0, "replays": 0, "max_link_generation": 4,
            "max_link_width": 8}  # an older driver: the device-only call is NOT_SUPPORTED
    b = backend(FakeNvml([gpu(pcie=link, pcie_count=counted(0, 0, U32))]))
    b.sample_devices()
    assert b._pcie_counters.narrow_period() == pytest.approx(2**32 / 32e9 / 3)  # Gen4 x16


def test_a_round_reads_every_narrow_gpu_and_leaves_a_failing_one_to_the_careful_path() -> None:
    # Three narrow GPUs; one then loses its byte-count fields, one answers a field error.
    clock = Clock()
    fake = FakeNvml([gpu(index=i, pcie_count=counted(0, 0, U32)) for i in range(3)])
    b = backend(fake, clock=clock)
    b.sample_devices()
    counters = b._pcie_counters
    snapshot = b._session.snapshot()
    assert snapshot is not None
    lib, gpus = snapshot
    tx_id = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
    fake.gpus[1]["field_errors"] = {tx_id: pynvml.NVML_ERROR_NOT_SUPPORTED}
    fake.gpus[2]["field_errors"] = {tx_id: pynvml.NVML_ERROR_UNKNOWN}
    true = 0.0
    for _ in range(10):
        clock.now += 0.02
        true += RATE * 0.02
        for g in fake.gpus:
            g["pcie_count"] = counted(true, true / 2, U32)
        failed = counters.poll_round(lib, gpus)
        assert [(g.index, type(e).__name__) for g, e in failed] == [(2, "NVMLError_Unknown")]
    uuid2 = gpus[2].identity.uuid
    assert counters.absent(gpus[1].identity.uuid) and not counters.absent(uuid2)
    fake.gpus[2]["field_errors"] = {}
    first, _, third = b.sample_devices()
    assert first.pcie_tx_bytes_total == int(true) and first.pcie_rx_bytes_total == int(true / 2)
    # Nothing was applied from the failed reads: the sampler's read comes 0.2 s after the
    # last good one, too late for a 32-bit counter at this rate, and is dropped as a gap.
    assert third.pcie_tx_bytes_total == 0.0
    assert sum(n for (d, _), n in counters.dropped(uuid2).items() if d == "tx") == 1


def test_a_round_told_to_stop_applies_what_it_read_and_reads_no_further() -> None:
    clock = Clock()
    fake = FakeNvml([gpu(index=i, pcie_count=counted(0, 0, U32)) for i in range(2)])
    b = backend(fake, clock=clock)
    b.sample_devices()
    snapshot = b._session.snapshot()
    assert snapshot is not None
    lib, gpus = snapshot
    stop = threading.Event()
    read = fake.nvmlDeviceGetFieldValues

    def read_then_stop(handle, fields):  # type: ignore[no-untyped-def]
        stop.set()  # stopping while the first GPU is read
        return read(handle, fields)

    fake.nvmlDeviceGetFieldValues = read_then_stop  # type: ignore[method-assign]
    clock.now += 0.02
    for g in fake.gpus:
        g["pcie_count"] = counted(RATE * 0.02, 0, U32)
    assert b._pcie_counters.poll_round(lib, gpus, stop) == []
    fake.nvmlDeviceGetFieldValues = read  # type: ignore[method-assign]
    first, second = b.sample_devices()
    assert first.pcie_tx_bytes_total == int(RATE * 0.02)  # read and applied
    assert second.pcie_tx_bytes_total == int(RATE * 0.02)  # read later, by the sampler
