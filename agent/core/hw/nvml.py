"""The NVML adapter: device state and GPM activity from NVIDIA's management library.

This is the only module in the project that talks to ``pynvml`` (package nvidia-ml-py). It is
imported lazily, inside :class:`NvmlBackend`, so a host without the package or the driver can
still import the agent; tests pass a hand-written fake as ``lib``.

What it does beyond calling NVML:

* converts NVML's units to the project's base units (ratios 0-1, bytes, bytes per second,
  watts, hertz, seconds); the factors are named constants below, each with where the unit
  comes from;
* remembers per GPU which queries answered NOT_SUPPORTED, so they are neither retried nor
  logged again on every sample, and the field stays ``None`` (an absent series, never a zero);
* keeps PCIe throughput off the sampling path: ``nvmlDeviceGetPcieThroughput`` blocks ~20 ms
  per call, so a small background thread reads it and samples take its latest values, reporting
  ``None`` once they are older than ``pcie_stale_after``;
* translates NVML errors into :class:`~agent.core.hw.base.SourceUnavailable` (the source does not
  apply here) or :class:`~agent.core.hw.base.HardwareError` (it failed now); after a failure the next
  call shuts NVML down, initialises it again and fetches fresh handles, so the collector
  recovers on its own when NVML answers again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from agent.core.hw.base import (
    DeviceSample,
    GpmSample,
    GPUIdentity,
    HardwareError,
    SourceUnavailable,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# --- Units -----------------------------------------------------------------------------------
# Each factor names the NVML unit it undoes and where that unit is stated.

#: Utilisation rates, GetSamples utilisation values and GPM ``*_UTIL`` metrics are percentages
#: (0-100) in NVML's docs (nvmlUtilization_t, nvmlGpmMetricId_t "0.0 - 100.0").
PERCENT = 100.0
#: nvmlDeviceGetPcieThroughput: "Reference in which to return throughput in KB/s" (NVML API
#: reference). NVML does not say which KB; we take 1024 bytes, the same kilo NVML spells out as
#: KiB for the NVLink throughput fields, so PCIe and NVLink bytes share one convention.
PCIE_KB_PER_S_TO_BYTES_PER_S = 1024.0
#: NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX: "NVLink TX/RX Data throughput in KiB" (pynvml /
#: nvml.h comment on the field ids); a cumulative counter, so bytes = KiB * 1024.
NVLINK_KIB_TO_BYTES = 1024.0
#: NVML_GPM_METRIC_PCIE_*_PER_SEC and NVML_GPM_METRIC_NVLINK_TOTAL_*_PER_SEC: "in MiB/sec"
#: (nvmlGpmMetricId_t docs and pynvml comments).
GPM_MIB_PER_S_TO_BYTES_PER_S = 1024.0 * 1024.0
#: nvmlDeviceGetPowerUsage returns milliwatts.
MILLIWATTS_PER_WATT = 1000.0
#: nvmlDeviceGetClockInfo returns MHz.
HERTZ_PER_MEGAHERTZ = 1_000_000.0
#: nvmlSample_t.timeStamp: "CPU Timestamp in microseconds" of the wall clock (Unix epoch).
MICROSECONDS_PER_SECOND = 1_000_000.0

#: A burst of XID events is drained up to this many per GPU per sample; the rest stay queued in
#: NVML for the next sample, so one sample never spins on a storm.
MAX_EVENTS_PER_POLL = 256

# --- PCIe throughput thread ------------------------------------------------------------------
# nvmlDeviceGetPcieThroughput "is querying a byte counter over a 20ms interval" (NVML API
# reference) and blocks for that window: TX+RX cost ~40 ms per GPU, ~320 ms per pass on 8 GPUs,
# which the sampler's 0.1 s pace cannot afford. A dedicated thread reads it instead.

#: Name of the background thread (shows up in py-spy dumps and thread listings).
PCIE_THREAD_NAME = "mrc-agent-nvml-pcie"
#: Pause between two rounds over all GPUs, in seconds.
DEFAULT_PCIE_PERIOD_S = 0.25
#: A value older than this (seconds, monotonic) is reported as absent, never as a stale number.
DEFAULT_PCIE_STALE_AFTER_S = 5.0
#: close() waits this long for the thread; only a hung NVML call can take longer (the thread is
#: a daemon, so even then it does not keep the process alive).
PCIE_JOIN_TIMEOUT_S = 2.0


def percent_to_ratio(percent: float) -> float:
    """NVML percent (0-100) to a 0-1 ratio."""
    return float(percent) / PERCENT


def pcie_kb_per_s_to_bytes_per_s(kb_per_s: float) -> float:
    """nvmlDeviceGetPcieThroughput's KB/s to bytes per second."""
    return float(kb_per_s) * PCIE_KB_PER_S_TO_BYTES_PER_S


def nvlink_kib_to_bytes(kib: float) -> float:
    """NVLink throughput field value (KiB, cumulative) to bytes."""
    return float(kib) * NVLINK_KIB_TO_BYTES


def gpm_mib_per_s_to_bytes_per_s(mib_per_s: float) -> float:
    """GPM PCIe/NVLink MiB/s to bytes per second."""
    return float(mib_per_s) * GPM_MIB_PER_S_TO_BYTES_PER_S


def milliwatts_to_watts(milliwatts: float) -> float:
    return float(milliwatts) / MILLIWATTS_PER_WATT


def megahertz_to_hertz(megahertz: float) -> float:
    return float(megahertz) * HERTZ_PER_MEGAHERTZ


def nvml_timestamp_to_monotonic(timestamp_us: int, *, mono_now: float, wall_now: float) -> float:
    """Map an NVML sample timestamp (wall clock, microseconds) onto the monotonic clock.

    The sample's age is measured on the wall clock and subtracted from "now" on the monotonic
    clock, so a wall-clock step between samples moves at most the current batch. Clamped to
    ``mono_now``: small disagreements between the two clocks must not date a sample in the
    future.
    """
    age = wall_now - timestamp_us / MICROSECONDS_PER_SECOND
    return min(mono_now, mono_now - age)


# --- State -----------------------------------------------------------------------------------


@dataclass
class _Gpu:
    """One GPU as seen by the current NVML session (handles die with the session)."""

    index: int
    handle: Any
    identity: GPUIdentity
    event_set: Any | None = None
    #: Active NVLink link indices; ``None`` until first discovered in this session.
    nvlinks: list[int] | None = None
    #: Two GPM sample buffers used alternately: the previous sample and the one being taken.
    gpm_buffers: list[Any] = field(default_factory=list)
    gpm_next: int = 0
    gpm_primed: bool = False


@dataclass(frozen=True)
class _PcieReading:
    """The PCIe thread's latest TX/RX rates for one GPU, in bytes per second."""

    #: When the reads finished, on the backend's monotonic clock.
    taken_at: float
    tx_bytes_per_second: float
    rx_bytes_per_second: float


#: GPM metric id attribute name in pynvml -> GpmSample attribute, and the converter applied.
_GPM_METRICS: tuple[tuple[str, str, Callable[[float], float]], ...] = (
    ("NVML_GPM_METRIC_SM_UTIL", "sm_util", percent_to_ratio),
    ("NVML_GPM_METRIC_SM_OCCUPANCY", "sm_occupancy", percent_to_ratio),
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", "tensor_util", percent_to_ratio),
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", "dram_bw_util", percent_to_ratio),
    ("NVML_GPM_METRIC_PCIE_TX_PER_SEC", "pcie_tx_bytes_per_second", gpm_mib_per_s_to_bytes_per_s),
    ("NVML_GPM_METRIC_PCIE_RX_PER_SEC", "pcie_rx_bytes_per_second", gpm_mib_per_s_to_bytes_per_s),
    (
        "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC",
        "nvlink_tx_bytes_per_second",
        gpm_mib_per_s_to_bytes_per_s,
    ),
    (
        "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC",
        "nvlink_rx_bytes_per_second",
        gpm_mib_per_s_to_bytes_per_s,
    ),
)

#: nvmlValue_t union member for each NVML_VALUE_TYPE_* constant.
_VALUE_MEMBERS = (
    ("NVML_VALUE_TYPE_DOUBLE", "dVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
    ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),
)


def _text(value: Any) -> str:
    # pynvml returns str on Python 3, but older releases and some fakes hand back bytes.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """NVML device and GPM source; implements ``DeviceSource`` and ``GpmSource``.

    ``lib`` is the ``pynvml`` module or a stand-in with the same names; ``None`` imports
    ``pynvml`` on first use. ``clock`` is the monotonic clock samples are stamped with;
    ``wall_clock`` is the clock NVML's sample timestamps are taken on (the Unix epoch).
    All public methods are safe to call from several threads.

    PCIe throughput is read by a daemon thread (:data:`PCIE_THREAD_NAME`) started by the first
    successful :meth:`sample_devices` and stopped by :meth:`close`: one round over the GPUs,
    then a pause of ``pcie_period`` seconds. Samples report its latest values, or ``None`` when
    they are older than ``pcie_stale_after`` seconds. ``pcie_thread=False`` starts no thread;
    the values then only come from calling :meth:`_pcie_round` (what the tests do).
    """

    def __init__(
        self,
        lib: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        wall_clock: Callable[[], float] = time.time,
        pcie_period: float = DEFAULT_PCIE_PERIOD_S,
        pcie_stale_after: float = DEFAULT_PCIE_STALE_AFTER_S,
        pcie_thread: bool = True,
    ) -> None:
        if pcie_period < 0:
            raise ValueError(f"pcie_period must be >= 0, not {pcie_period}")
        if pcie_stale_after <= 0:
            raise ValueError(f"pcie_stale_after must be > 0, not {pcie_stale_after}")
        self._lib: Any | None = lib
        self._clock = clock
        self._wall_clock = wall_clock
        # One NVML session is shared by device and GPM sampling, and re-initialising it while
        # another thread holds handles would hand that thread dead handles.
        self._lock = threading.RLock()
        self._initialized = False
        self._needs_reinit = False
        self._failing = False
        self._gpus: list[_Gpu] = []
        # Remembered across NVML sessions, keyed by GPU UUID: a re-init after a GPU error must
        # not forget capabilities, reset the XID counter or re-read old utilisation samples.
        self._unsupported: set[tuple[str, str]] = set()
        self._gpm_support: dict[str, bool] = {}
        self._last_util_timestamp: dict[str, int] = {}
        self._xid_total: dict[str, int] = {}
        self._last_xid: dict[str, int] = {}
        self._logged: set[str] = set()
        # The PCIe thread. It reads NVML without ``_lock`` (NVML API reference, introduction,
        # https://docs.nvidia.com/deploy/nvml-api/nvml-api-reference.html: "NVML is thread-safe
        # so it is safe to make simultaneous NVML calls from multiple threads"; and
        # pynvml calls through ctypes.CDLL, which releases the GIL during the call), so the
        # sampler never waits behind its 20 ms reads. What it shares with the sampler
        # (``_unsupported``, ``_logged``, ``_pcie_latest``) is guarded by ``_shared_lock``, which
        # is never held across an NVML call nor while taking ``_lock``.
        self._shared_lock = threading.Lock()
        self._pcie_latest: dict[str, _PcieReading] = {}
        self._pcie_period = pcie_period
        self._pcie_stale_after = pcie_stale_after
        self._pcie_thread_enabled = pcie_thread
        #: The running thread and the event that stops it; each thread gets its own event.
        self._pcie_worker: tuple[threading.Thread, threading.Event] | None = None

    # --- public API --------------------------------------------------------------------------

    def sample_devices(self) -> list[DeviceSample]:
        """One :class:`DeviceSample` per GPU. Raises SourceUnavailable or HardwareError."""
        with self._lock:
            gpus = self._ensure_ready()
            lib = self._require_lib()
            try:
                samples = [self._sample_device(lib, gpu) for gpu in gpus]
            except lib.NVMLError as err:
                raise self._failure(err, "sampling devices") from err
            self._note_success()
            self._start_pcie_thread()
            return samples

    def sample_gpm(self) -> list[GpmSample]:
        """One :class:`GpmSample` per GPM-capable GPU; a GPU's first call only primes it.

        Raises ``SourceUnavailable("gpm_unsupported")`` when no GPU supports GPM.
        """
        with self._lock:
            gpus = self._ensure_ready()
            lib = self._require_lib()
            out: list[GpmSample] = []
            try:
                for gpu in gpus:
                    if not self._gpm_supported(lib, gpu):
                        continue
                    sample = self._sample_gpm(lib, gpu)
                    if sample is not None:
                        out.append(sample)
            except lib.NVMLError as err:
                raise self._failure(err, "sampling GPM") from err
            if not any(self._gpm_support.get(gpu.identity.uuid) for gpu in gpus):
                raise self._unavailable(
                    "gpm_unsupported", "no GPU supports NVML GPM (Hopper or newer is required)"
                )
            self._note_success()
            return out

    def info(self) -> dict[str, Any]:
        """What ``doctor`` prints: versions, GPUs and their capabilities, and any error text.

        Never raises for NVML trouble: a failure is reported in ``reason``/``error``.
        """
        with self._lock:
            out: dict[str, Any] = {
                "available": False,
                "reason": None,
                "error": None,
                "driver_version": None,
                "nvml_version": None,
                "cuda_driver_version": None,
                "gpus": [],
            }
            try:
                gpus = self._ensure_ready()
            except SourceUnavailable as err:
                out["reason"], out["error"] = err.reason, str(err)
                return out
            except HardwareError as err:
                out["error"] = str(err)
                return out
            lib = self._require_lib()
            out["available"] = True
            errors: list[str] = []
            versions: tuple[tuple[str, Callable[[], Any]], ...] = (
                ("driver_version", lambda: _text(lib.nvmlSystemGetDriverVersion())),
                ("nvml_version", lambda: _text(lib.nvmlSystemGetNVMLVersion())),
                (
                    "cuda_driver_version",
                    lambda: _cuda_version(lib.nvmlSystemGetCudaDriverVersion()),
                ),
            )
            for key, query in versions:
                try:
                    out[key] = query()
                except lib.NVMLError as err:
                    errors.append(f"{key}: {err}")
            for gpu in gpus:
                out["gpus"].append(self._gpu_info(lib, gpu))
            if errors:
                out["error"] = "; ".join(errors)
            return out

    def close(self) -> None:
        """Stop the PCIe thread, free event sets and GPM buffers and shut NVML down.

        Safe to call twice. A later :meth:`sample_devices` starts NVML and the thread again.
        """
        with self._lock:
            worker, self._pcie_worker = self._pcie_worker, None
        if worker is not None:
            thread, stop = worker
            stop.set()  # wakes its pause at once; a round in progress ends after its current GPU
            # Joined without ``_lock``: the thread takes it for its snapshot of the GPUs.
            if thread is not threading.current_thread():
                thread.join(PCIE_JOIN_TIMEOUT_S)
                if thread.is_alive():
                    log.warning(
                        "PCIe throughput thread still in an NVML call after %.1f s; "
                        "shutting NVML down anyway",
                        PCIE_JOIN_TIMEOUT_S,
                    )
        with self._lock:
            if self._initialized:
                self._teardown()
            with self._shared_lock:
                self._pcie_latest.clear()

    # --- session ---------------------------------------------------------------------------

    def _require_lib(self) -> Any:
        if self._lib is None:
            try:
                import pynvml
            except ImportError as err:
                raise self._unavailable("nvml_missing", f"cannot import pynvml: {err}") from err
            self._lib = pynvml
        return self._lib

    def _ensure_ready(self) -> list[_Gpu]:
        if self._needs_reinit and self._initialized:
            self._teardown()
        if not self._initialized:
            self._init()
        return self._gpus

    def _init(self) -> None:
        lib = self._require_lib()
        try:
            lib.nvmlInit()
        except lib.NVMLError as err:
            raise self._failure(err, "initialising NVML") from err
        self._initialized = True
        self._needs_reinit = False
        try:
            count = int(lib.nvmlDeviceGetCount())
            gpus: list[_Gpu] = []
            denied = 0
            for index in range(count):
                try:
                    handle = lib.nvmlDeviceGetHandleByIndex(index)
                except lib.NVMLError as err:
                    # A GPU this process may not open (cgroup device rules) is skipped; the
                    # others are still worth sampling.
                    if err.value != lib.NVML_ERROR_NO_PERMISSION:
                        raise
                    denied += 1
                    self._log_once(
                        f"denied:{index}", logging.WARNING, "GPU %d: no permission, skipped", index
                    )
                    continue
                identity = GPUIdentity(
                    index=index,
                    uuid=_text(lib.nvmlDeviceGetUUID(handle)),
                    name=_text(lib.nvmlDeviceGetName(handle)),
                )
                gpu = _Gpu(index=index, handle=handle, identity=identity)
                gpu.event_set = self._register_xid_events(lib, gpu)
                gpus.append(gpu)
                self._gpus = gpus  # so a failure below still frees what was set up
        except lib.NVMLError as err:
            self._teardown()
            raise self._failure(err, "enumerating GPUs") from err
        if not gpus:
            self._teardown()
            if denied:
                raise self._unavailable("no_permission", f"no permission on any of {count} GPUs")
            raise self._unavailable("no_gpu", "NVML reports no GPU")
        self._gpus = gpus

    def _teardown(self) -> None:
        lib = self._lib
        if lib is not None:
            for gpu in self._gpus:
                for buffer in gpu.gpm_buffers:
                    self._quietly(
                        lib, "freeing a GPM sample", partial(lib.nvmlGpmSampleFree, buffer)
                    )
                if gpu.event_set is not None:
                    free = partial(lib.nvmlEventSetFree, gpu.event_set)
                    self._quietly(lib, "freeing an event set", free)
            if self._initialized:
                self._quietly(lib, "shutting NVML down", lib.nvmlShutdown)
        self._gpus = []
        self._initialized = False
        self._needs_reinit = False

    def _quietly(self, lib: Any, what: str, call: Callable[[], object]) -> None:
        # Teardown runs after failures, when NVML is expected to refuse; recovery must go on.
        try:
            call()
        except lib.NVMLError as err:
            log.debug("ignored NVML error while %s: %s", what, err)

    # --- error mapping -----------------------------------------------------------------------

    def _failure(self, err: Any, what: str) -> HardwareError:
        """Translate an NVMLError; every failure makes the next call start a fresh session."""
        lib = self._require_lib()
        self._needs_reinit = True
        reasons = {
            lib.NVML_ERROR_LIBRARY_NOT_FOUND: "nvml_missing",
            lib.NVML_ERROR_DRIVER_NOT_LOADED: "driver_not_loaded",
            lib.NVML_ERROR_NO_PERMISSION: "no_permission",
        }
        reason = reasons.get(err.value)
        if reason is not None:
            return self._unavailable(reason, f"{what}: {err}")
        if not self._failing:
            # Logged on the transition to failing only; the runner exports the ongoing state.
            log.warning(
                "NVML failed while %s: %s (code %s); will re-initialise", what, err, err.value
            )
        self._failing = True
        return HardwareError(f"NVML error while {what}: {err} (code {err.value})")

    def _unavailable(self, reason: str, detail: str) -> SourceUnavailable:
        self._log_once(
            f"unavailable:{reason}", logging.WARNING, "NVML unavailable (%s): %s", reason, detail
        )
        return SourceUnavailable(reason, detail)

    def _note_success(self) -> None:
        if self._failing:
            log.info("NVML answers again")
        self._failing = False

    def _log_once(self, key: str, level: int, msg: str, *args: object) -> None:
        with self._shared_lock:  # the PCIe thread logs too
            if key in self._logged:
                return
            self._logged.add(key)
        log.log(level, msg, *args)

    def _optional(
        self,
        lib: Any,
        gpu: _Gpu,
        feature: str,
        call: Callable[[], T],
        *,
        empty: Iterable[int] = (),
    ) -> T | None:
        """Run one query; ``None`` if this GPU does not support it (remembered, logged once).

        Codes in ``empty`` mean "nothing to report this time" and are neither remembered nor
        logged. Any other error propagates and fails the whole sample.
        Called from the PCIe thread too: the memory of unsupported queries is shared.
        """
        key = (gpu.identity.uuid, feature)
        with self._shared_lock:
            if key in self._unsupported:
                return None
        try:
            return call()
        except lib.NVMLError as err:
            if err.value in set(empty):
                return None
            if err.value not in _unsupported_codes(lib):
                raise
            with self._shared_lock:
                self._unsupported.add(key)
            self._log_once(
                f"unsupported:{key}",
                logging.INFO,
                "GPU %d (%s): %s not available (%s); leaving it absent",
                gpu.index,
                gpu.identity.uuid,
                feature,
                err,
            )
            return None

    # --- device sampling ---------------------------------------------------------------------

    def _sample_device(self, lib: Any, gpu: _Gpu) -> DeviceSample:
        h = gpu.handle
        s = DeviceSample(gpu=gpu.identity)

        util = self._optional(lib, gpu, "utilization", lambda: lib.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            s.gpu_util = percent_to_ratio(util.gpu)
            s.mem_util = percent_to_ratio(util.memory)
        s.util_samples = self._util_samples(lib, gpu)

        s.mem_used_bytes, s.mem_total_bytes = self._memory(lib, gpu)

        # Not read here: each call blocks 20 ms. The PCIe thread's latest values, if fresh.
        pcie = self._fresh_pcie(gpu.identity.uuid)
        if pcie is not None:
            s.pcie_tx_bytes_per_second = pcie.tx_bytes_per_second
            s.pcie_rx_bytes_per_second = pcie.rx_bytes_per_second
        replays = self._optional(
            lib, gpu, "pcie_replay_counter", lambda: lib.nvmlDeviceGetPcieReplayCounter(h)
        )
        if replays is not None:
            s.pcie_replays_total = float(replays)

        self._nvlink(lib, gpu, s)

        power = self._optional(lib, gpu, "power_usage", lambda: lib.nvmlDeviceGetPowerUsage(h))
        if power is not None:
            s.power_watts = milliwatts_to_watts(power)
        clock = self._optional(
            lib, gpu, "sm_clock", lambda: lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_SM)
        )
        if clock is not None:
            s.sm_clock_hertz = megahertz_to_hertz(clock)
        temp = self._optional(
            lib,
            gpu,
            "temperature",
            lambda: lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU),
        )
        if temp is not None:
            s.temperature_celsius = float(temp)

        ecc = self._optional(
            lib,
            gpu,
            "ecc_errors",
            lambda: (
                lib.nvmlDeviceGetTotalEccErrors(
                    h, lib.NVML_MEMORY_ERROR_TYPE_CORRECTED, lib.NVML_VOLATILE_ECC
                ),
                lib.nvmlDeviceGetTotalEccErrors(
                    h, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC
                ),
            ),
        )
        if ecc is not None:
            s.ecc_corrected_total, s.ecc_uncorrected_total = float(ecc[0]), float(ecc[1])

        self._poll_xid(lib, gpu, s)
        s.process_memory_bytes = self._process_memory(lib, gpu)
        return s

    def _fresh_pcie(self, uuid: str) -> _PcieReading | None:
        """The PCIe thread's latest reading for this GPU; None if none or too old."""
        with self._shared_lock:
            reading = self._pcie_latest.get(uuid)
        if reading is None or self._clock() - reading.taken_at > self._pcie_stale_after:
            return None
        return reading

    # --- PCIe throughput thread ----------------------------------------------------------------

    def _start_pcie_thread(self) -> None:
        """Start the PCIe thread unless it runs or is disabled. Called holding ``_lock``."""
        if not self._pcie_thread_enabled or self._pcie_worker is not None:
            return
        stop = threading.Event()
        thread = threading.Thread(
            target=self._pcie_loop, args=(stop,), name=PCIE_THREAD_NAME, daemon=True
        )
        self._pcie_worker = (thread, stop)
        thread.start()

    def _pcie_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self._pcie_round(stop)
            except Exception as err:  # a bug must not end the thread silently, nor spam
                self._log_once(
                    f"pcie_thread:{type(err).__name__}",
                    logging.WARNING,
                    "PCIe throughput round failed: %r",
                    err,
                )
            stop.wait(self._pcie_period)

    def _pcie_round(self, stop: threading.Event | None = None) -> None:
        """One round over the current GPUs: read TX and RX throughput, publish the values.

        Does nothing while NVML is not initialised. Never raises for NVML errors.
        """
        snapshot = self._pcie_snapshot()
        if snapshot is not None:
            self._pcie_read(*snapshot, stop=stop)

    def _pcie_snapshot(self) -> tuple[Any, list[_Gpu]] | None:
        """The library and this session's GPUs, taken under ``_lock`` and used without it."""
        with self._lock:
            if not self._initialized or self._lib is None:
                return None
            return self._lib, list(self._gpus)

    def _pcie_read(
        self, lib: Any, gpus: list[_Gpu], *, stop: threading.Event | None = None
    ) -> None:
        for gpu in gpus:
            if stop is not None and stop.is_set():
                return
            uuid = gpu.identity.uuid
            try:
                kb = self._optional(
                    lib, gpu, "pcie_throughput", partial(_pcie_throughput, lib, gpu.handle)
                )
            except lib.NVMLError as err:
                # E.g. a handle from a session the sampler has since re-initialised, or a GPU
                # that is lost: the sampler notices and recovers; this GPU waits a round.
                self._log_once(
                    f"pcie_error:{uuid}",
                    logging.DEBUG,
                    "GPU %d (%s): reading PCIe throughput failed (%s); skipped this round",
                    gpu.index,
                    uuid,
                    err,
                )
                continue
            if kb is None:  # not supported: remembered by _optional, never read again
                with self._shared_lock:
                    self._pcie_latest.pop(uuid, None)
                continue
            reading = _PcieReading(
                taken_at=self._clock(),
                tx_bytes_per_second=pcie_kb_per_s_to_bytes_per_s(kb[0]),
                rx_bytes_per_second=pcie_kb_per_s_to_bytes_per_s(kb[1]),
            )
            with self._shared_lock:
                self._pcie_latest[uuid] = reading

    def _util_samples(self, lib: Any, gpu: _Gpu) -> list[tuple[float, float]]:
        uuid = gpu.identity.uuid
        last = self._last_util_timestamp.get(uuid, 0)
        # NOT_FOUND is NVML's answer when no sample is newer than ``last``.
        got = self._optional(
            lib,
            gpu,
            "utilization_samples",
            lambda: lib.nvmlDeviceGetSamples(gpu.handle, lib.NVML_GPU_UTILIZATION_SAMPLES, last),
            empty=(lib.NVML_ERROR_NOT_FOUND,),
        )
        if not got:
            return []
        value_type, samples = got
        mono_now, wall_now = self._clock(), self._wall_clock()
        out: list[tuple[float, float]] = []
        newest = last
        for sample in sorted(samples, key=lambda smp: int(smp.timeStamp)):
            stamp = int(sample.timeStamp)
            if stamp <= last:
                continue  # the buffer may repeat the boundary sample
            value = _union_value(lib, value_type, sample.sampleValue)
            when = nvml_timestamp_to_monotonic(stamp, mono_now=mono_now, wall_now=wall_now)
            out.append((when, percent_to_ratio(value)))
            newest = max(newest, stamp)
        self._last_util_timestamp[uuid] = newest
        return out

    def _memory(self, lib: Any, gpu: _Gpu) -> tuple[float | None, float | None]:
        h = gpu.handle
        # v2 reports driver-reserved memory separately, so ``used`` is what processes hold;
        # v1's ``used`` includes the reservation. Older drivers only have v1.
        mem = self._optional(
            lib,
            gpu,
            "memory_info_v2",
            lambda: lib.nvmlDeviceGetMemoryInfo(h, version=lib.nvmlMemory_v2),
        )
        if mem is None:
            mem = self._optional(lib, gpu, "memory_info", lambda: lib.nvmlDeviceGetMemoryInfo(h))
        if mem is None:
            return None, None
        return float(mem.used), float(mem.total)

    def _nvlink(self, lib: Any, gpu: _Gpu, s: DeviceSample) -> None:
        if gpu.nvlinks is None:
            gpu.nvlinks = self._discover_nvlinks(lib, gpu)
        links = gpu.nvlinks
        if not links:
            return
        tx_id, rx_id = (
            lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
            lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        )
        # scopeId selects the link; one call fetches every link's TX and RX together.
        request = [(tx_id, link) for link in links] + [(rx_id, link) for link in links]
        values = self._optional(
            lib, gpu, "nvlink_throughput", lambda: lib.nvmlDeviceGetFieldValues(gpu.handle, request)
        )
        if values is None:
            return
        tx: dict[int, float] = {}
        rx: dict[int, float] = {}
        for value in list(values)[: len(request)]:
            kib = self._field_value(
                lib, gpu, value, f"nvlink_field_{value.fieldId}_link_{value.scopeId}"
            )
            if kib is None:
                continue
            (tx if value.fieldId == tx_id else rx)[int(value.scopeId)] = nvlink_kib_to_bytes(kib)
        per_link = {link: (tx[link], rx[link]) for link in links if link in tx and link in rx}
        if per_link:
            s.nvlink_links = per_link
            s.nvlink_tx_bytes_total = sum(t for t, _ in per_link.values())
            s.nvlink_rx_bytes_total = sum(r for _, r in per_link.values())

    def _discover_nvlinks(self, lib: Any, gpu: _Gpu) -> list[int]:
        """Active link indices; [] when the GPU has no NVLink."""
        count: int | None = None
        got = self._optional(
            lib,
            gpu,
            "nvlink_link_count",
            lambda: lib.nvmlDeviceGetFieldValues(gpu.handle, [lib.NVML_FI_DEV_NVLINK_LINK_COUNT]),
        )
        if got is not None:
            raw = self._field_value(lib, gpu, got[0], "nvlink_link_count")
            count = int(raw) if raw is not None else None
        # Without a count, probe up to the library's maximum and stop at the first link NVML
        # does not know.
        limit = count if count is not None else int(lib.NVML_NVLINK_MAX_LINKS)
        stop_codes = _unsupported_codes(lib) | {lib.NVML_ERROR_INVALID_ARGUMENT}
        active: list[int] = []
        for link in range(limit):
            try:
                state = lib.nvmlDeviceGetNvLinkState(gpu.handle, link)
            except lib.NVMLError as err:
                if err.value not in stop_codes:
                    raise
                if count is None:
                    break
                continue
            if state == lib.NVML_FEATURE_ENABLED:
                active.append(link)
        if not active:
            self._log_once(
                f"nvlink:{gpu.identity.uuid}",
                logging.INFO,
                "GPU %d (%s): no active NVLink; NVLink series stay absent",
                gpu.index,
                gpu.identity.uuid,
            )
        return active

    def _field_value(self, lib: Any, gpu: _Gpu, value: Any, feature: str) -> float | None:
        """The number in one nvmlFieldValue_t, or None if NVML did not support that field."""
        if value.nvmlReturn == lib.NVML_SUCCESS:
            return _union_value(lib, value.valueType, value.value)
        if value.nvmlReturn in _unsupported_codes(lib):
            self._log_once(
                f"unsupported:{gpu.identity.uuid}:{feature}",
                logging.INFO,
                "GPU %d (%s): field %s not supported; leaving it absent",
                gpu.index,
                gpu.identity.uuid,
                feature,
            )
            return None
        # A per-field GPU_IS_LOST or similar is the same failure as a whole-call one.
        raise lib.NVMLError(value.nvmlReturn)

    def _register_xid_events(self, lib: Any, gpu: _Gpu) -> Any | None:
        """An event set for this GPU's XID errors, or None where events are not supported.

        One set per GPU, so every event is attributed to its GPU without comparing handles.
        """
        event_set = self._optional(lib, gpu, "xid_events", lib.nvmlEventSetCreate)
        if event_set is None:
            return None

        def register() -> bool:
            lib.nvmlDeviceRegisterEvents(gpu.handle, lib.nvmlEventTypeXidCriticalError, event_set)
            return True

        try:
            registered = self._optional(lib, gpu, "xid_events", register)
        except lib.NVMLError:
            self._quietly(lib, "freeing an event set", lambda: lib.nvmlEventSetFree(event_set))
            raise
        if registered is None:
            self._quietly(lib, "freeing an event set", lambda: lib.nvmlEventSetFree(event_set))
            return None
        self._xid_total.setdefault(gpu.identity.uuid, 0)
        return event_set

    def _poll_xid(self, lib: Any, gpu: _Gpu, s: DeviceSample) -> None:
        if gpu.event_set is None:
            return
        uuid = gpu.identity.uuid
        for _ in range(MAX_EVENTS_PER_POLL):
            try:
                # Timeout 0: return at once; NVML_ERROR_TIMEOUT here only means "no event".
                event = lib.nvmlEventSetWait(gpu.event_set, 0)
            except lib.NVMLError as err:
                if err.value == lib.NVML_ERROR_TIMEOUT:
                    break
                raise
            if int(event.eventType) & int(lib.nvmlEventTypeXidCriticalError):
                self._xid_total[uuid] = self._xid_total.get(uuid, 0) + 1
                self._last_xid[uuid] = int(event.eventData)
        s.xid_errors_total = float(self._xid_total.get(uuid, 0))
        last = self._last_xid.get(uuid)
        s.last_xid = float(last) if last is not None else None

    def _process_memory(self, lib: Any, gpu: _Gpu) -> dict[int, float]:
        h = gpu.handle
        out: dict[int, float] = {}
        for feature, query in (
            ("compute_processes", lib.nvmlDeviceGetComputeRunningProcesses),
            ("graphics_processes", lib.nvmlDeviceGetGraphicsRunningProcesses),
        ):
            procs = self._optional(lib, gpu, feature, partial(query, h))
            for proc in procs or ():
                used = proc.usedGpuMemory
                if used is None:
                    continue  # pynvml's spelling of NVML_VALUE_NOT_AVAILABLE (e.g. WDDM)
                pid = int(proc.pid)
                # A process with both a compute and a graphics context is listed twice with
                # the same total; summing would double-count it.
                out[pid] = max(out.get(pid, 0.0), float(used))
        return out

    # --- GPM ---------------------------------------------------------------------------------

    def _gpm_supported(self, lib: Any, gpu: _Gpu) -> bool:
        uuid = gpu.identity.uuid
        if uuid not in self._gpm_support:
            support = self._optional(
                lib, gpu, "gpm", lambda: lib.nvmlGpmQueryDeviceSupport(gpu.handle)
            )
            supported = bool(support is not None and support.isSupportedDevice)
            self._gpm_support[uuid] = supported
            if not supported:
                self._log_once(
                    f"gpm:{uuid}", logging.INFO, "GPU %d (%s): no GPM support", gpu.index, uuid
                )
        return self._gpm_support[uuid]

    def _sample_gpm(self, lib: Any, gpu: _Gpu) -> GpmSample | None:
        if not gpu.gpm_buffers:
            gpu.gpm_buffers = [lib.nvmlGpmSampleAlloc(), lib.nvmlGpmSampleAlloc()]
        current = gpu.gpm_buffers[gpu.gpm_next]

        def take() -> bool:
            lib.nvmlGpmSampleGet(gpu.handle, current)
            return True

        taken = self._optional(lib, gpu, "gpm", take)
        if taken is None:
            # The device said yes to GPM but will not sample (e.g. MIG mode at device level).
            self._gpm_support[gpu.identity.uuid] = False
            return None
        previous = gpu.gpm_buffers[gpu.gpm_next ^ 1]
        gpu.gpm_next ^= 1
        if not gpu.gpm_primed:
            # GPM metrics are computed between two samples; the first one only sets the start.
            gpu.gpm_primed = True
            return None

        wanted = [(int(getattr(lib, name)), attr, convert) for name, attr, convert in _GPM_METRICS]
        request = lib.c_nvmlGpmMetricsGet_t()
        request.version = lib.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(wanted)
        request.sample1 = previous  # older
        request.sample2 = current  # newer
        for i, (metric_id, _, _) in enumerate(wanted):
            request.metrics[i].metricId = metric_id
        lib.nvmlGpmMetricsGet(request)

        out = GpmSample(gpu=gpu.identity)
        for i, (metric_id, attr, convert) in enumerate(wanted):
            metric = request.metrics[i]
            if metric.nvmlReturn == lib.NVML_SUCCESS:
                setattr(out, attr, convert(metric.value))
            elif metric.nvmlReturn in _unsupported_codes(lib):
                # E.g. NVLink metrics on a PCIe-only board: absent, not zero.
                self._log_once(
                    f"gpm_metric:{gpu.identity.uuid}:{metric_id}",
                    logging.INFO,
                    "GPU %d (%s): GPM metric %s not supported; leaving it absent",
                    gpu.index,
                    gpu.identity.uuid,
                    attr,
                )
            else:
                raise lib.NVMLError(metric.nvmlReturn)
        return out

    # --- doctor ------------------------------------------------------------------------------

    def _gpu_info(self, lib: Any, gpu: _Gpu) -> dict[str, Any]:
        errors: list[str] = []
        gpm: bool | None = None
        links: int | None = None
        try:
            gpm = self._gpm_supported(lib, gpu)
        except lib.NVMLError as err:
            errors.append(f"gpm: {err}")
        try:
            if gpu.nvlinks is None:
                gpu.nvlinks = self._discover_nvlinks(lib, gpu)
            links = len(gpu.nvlinks)
        except lib.NVMLError as err:
            errors.append(f"nvlink: {err}")
        with self._shared_lock:
            unsupported = sorted(f for uuid, f in self._unsupported if uuid == gpu.identity.uuid)
        return {
            "index": gpu.index,
            "uuid": gpu.identity.uuid,
            "name": gpu.identity.name,
            "gpm_supported": gpm,
            "nvlink_active_links": links,
            "unsupported": unsupported,
            "errors": errors,
        }


def _unsupported_codes(lib: Any) -> set[int]:
    """NVML answers that mean "this GPU/driver/user will never get this field": not retried.

    NO_PERMISSION is here because a field restricted to root stays restricted for the process's
    life; FUNCTION_NOT_FOUND is an older driver without the entry point.
    """
    return {
        lib.NVML_ERROR_NOT_SUPPORTED,
        lib.NVML_ERROR_FUNCTION_NOT_FOUND,
        lib.NVML_ERROR_NO_PERMISSION,
    }


def _pcie_throughput(lib: Any, handle: Any) -> tuple[int, int]:
    """TX and RX PCIe throughput in KB/s; blocks ~20 ms per direction."""
    return (
        lib.nvmlDeviceGetPcieThroughput(handle, lib.NVML_PCIE_UTIL_TX_BYTES),
        lib.nvmlDeviceGetPcieThroughput(handle, lib.NVML_PCIE_UTIL_RX_BYTES),
    )


def _union_value(lib: Any, value_type: int, value: Any) -> float:
    """Read an nvmlValue_t union according to its NVML_VALUE_TYPE_*."""
    for const, member in _VALUE_MEMBERS:
        if value_type == getattr(lib, const):
            return float(getattr(value, member))
    raise HardwareError(f"NVML returned an unknown value type {value_type}")


def _cuda_version(raw: int) -> str:
    """nvmlSystemGetCudaDriverVersion's integer (e.g. 12040) as "12.4"."""
    return f"{raw // 1000}.{raw % 1000 // 10}"
