"""Opt-in profiling-counter source: true SM-instruction and DRAM-read counters via CUPTI PM
sampling (``cupti-python`` >= 13.3, ``cupti.pm_sampling``).

PM sampling programs the GPU's performance monitors to snapshot the chosen counters every
``interval_s`` into a hardware buffer; :meth:`CuptiPmSampler.sample_profiling` decodes whatever
intervals completed since the last call and adds them to running totals, so the collectors get
cumulative counters and ``rate()`` does the maths. The counters are device-wide, so a sidecar
process sees the inference service's kernels.

The call sequence is the one ``cupti.pm_sampling.Collector`` documents and NVIDIA's sample
``cupti-python-samples/CuptiPmSamplingVectorAddNumba.py`` uses:
``Collector(device_index) -> enable() -> configure(metrics=...) -> start() -> decode()* ->
stop() -> disable()``. Everything that touches CUPTI sits in the few ``_cupti_*`` methods so a
hand-written fake (``tests/fakes/fake_cupti.py``) can stand in for the library.

Failures before sampling runs become :class:`SourceUnavailable` with a bounded reason:
``cupti_missing``, ``no_gpu``, ``no_permission``, ``profiler_busy``, ``unsupported_device``.
Failures after a successful start become :class:`HardwareError`; the device is then restarted on
the next call and its totals carry on from where they were.

``GPUIdentity.index`` is used as the CUDA device index CUPTI expects. CUDA numbers devices
fastest-first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and ``CUDA_VISIBLE_DEVICES`` renumbers
them, while NVML uses PCI order; the sampler warns once when those can disagree.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product
from typing import Any

from mrc_agent.agent.core.hw.base import (
    GPUIdentity,
    HardwareError,
    ProfilingSample,
    SourceUnavailable,
)

log = logging.getLogger(__name__)

# Metric names, most preferred first. PM sampling only accepts metrics that its chip's
# PM-sampling counter set can collect in a single pass, and that set differs per chip, so the
# sampler tries these in order and keeps the first combination ``configure()`` accepts.
# Where the names come from:
# - ``sm__inst_executed_realtime``: the "realtime" SM counters are what PM-sampling users
#   configure (derivatives of NVIDIA's C ``pm_sampling`` sample, Nsight Compute's PM-sampling
#   section); the base name is in libnvperf_host.so 13.x's metric tables.
# - ``sm__inst_executed``: the range-profiler name (also in those tables), a fallback for chips
#   whose PM sampling set exposes it.
# - ``dram__bytes_read`` / ``dram__bytes_op_read``: both base names are in those tables; which
#   one a chip's PM sampling set accepts is only known on the chip.
# ``.sum`` is the rollup over all unit instances, so one sample is the device-wide count
# during that interval (instructions, or bytes).
SM_INSTRUCTION_METRICS: tuple[str, ...] = (
    "sm__inst_executed_realtime.sum",
    "sm__inst_executed.sum",
)
DRAM_READ_METRICS: tuple[str, ...] = ("dram__bytes_read.sum", "dram__bytes_op_read.sum")
#: The preferred pair; the names actually configured per GPU are logged when sampling starts.
PROFILING_METRICS: tuple[str, str] = (SM_INSTRUCTION_METRICS[0], DRAM_READ_METRICS[0])

#: Raw-record buffer CUPTI fills between decodes. The library default (512 MiB) is sized for
#: microsecond intervals; the agent samples at about 10 Hz and must not take memory from the
#: service it watches. The size of one record is not documented, so this is to be checked on a
#: GPU (an overflow shows up as a HardwareError from decode).
HARDWARE_BUFFER_BYTES = 32 * 1024 * 1024

#: Another profiler (Nsight, DCGM profiling) usually holds the counters only for a while, so a
#: busy device is tried again after this long instead of being given up for good.
BUSY_RETRY_S = 60.0

#: Decoded samples reserved per decode: room for this many seconds of intervals, so one decode
#: per scrape normally empties the hardware buffer.
_DECODE_WINDOW_S = 30.0

#: When a decode comes back full, records are still waiting; decode again, at most this often.
_MAX_DECODE_ROUNDS = 8

#: The bounded reasons a SourceUnavailable from this source carries.
_REASON_CODES = frozenset(
    {"cupti_missing", "no_gpu", "no_permission", "profiler_busy", "unsupported_device"}
)

#: CUPTI result codes (names of ``cupti.cupti.Result``, meanings from ``cupti_result.h``) that
#: mean this source cannot run here, and the bounded reason each becomes.
_REASON_BY_RESULT: dict[str, str] = {
    "ERROR_INSUFFICIENT_PRIVILEGES": "no_permission",
    "ERROR_VIRTUALIZED_DEVICE_INSUFFICIENT_PRIVILEGES": "no_permission",
    # "performance monitoring hardware is in use by other client"
    "ERROR_HARDWARE_BUSY": "profiler_busy",
    # also what CUPTI answers under Nsight Systems / Nsight Compute / cuda-gdb
    "ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED": "profiler_busy",
    # "CUPTI is disabled due to conflicts with other enabled profilers"
    "ERROR_DISABLED": "profiler_busy",
    "ERROR_OLD_PROFILER_API_INITIALIZED": "profiler_busy",
    "ERROR_NOT_SUPPORTED": "unsupported_device",
    "ERROR_VIRTUALIZED_DEVICE_NOT_SUPPORTED": "unsupported_device",
    "ERROR_CONFIDENTIAL_COMPUTING_NOT_SUPPORTED": "unsupported_device",
    "ERROR_CMP_DEVICE_NOT_SUPPORTED": "unsupported_device",
    "ERROR_MIG_DEVICE_NOT_SUPPORTED": "unsupported_device",
    "ERROR_SLI_DEVICE_NOT_SUPPORTED": "unsupported_device",
    "ERROR_WSL_DEVICE_NOT_SUPPORTED": "unsupported_device",
    "ERROR_INVALID_CHIP_NAME": "unsupported_device",
    "ERROR_INVALID_DEVICE": "no_gpu",
    # "unable to initialize its connection to the CUDA driver"
    "ERROR_NOT_INITIALIZED": "no_gpu",
}

#: cupti-python / cuda-pathfinder exception classes (all RuntimeError subclasses) raised when
#: libcupti.so or one of its functions cannot be loaded.
_MISSING_LIBRARY_ERRORS = frozenset(
    {"DynamicLibNotFoundError", "DynamicLibNotAvailableError", "FunctionNotFoundError"}
)

#: States a device can be in besides the reasons above.
_NOT_STARTED = "not_started"
_OK = "ok"
_HARDWARE_ERROR = "hardware_error"


@dataclass
class _Device:
    """Per-GPU sampling state. Totals stay ``None`` until a metric for them is configured."""

    gpu: GPUIdentity
    collector: Any = None
    sm_metric: str | None = None
    dram_metric: str | None = None
    sm_total: float | None = None
    dram_total: float | None = None
    state: str = _NOT_STARTED
    detail: str = ""
    retry_at: float | None = None


class CuptiPmSampler:
    """Cumulative SM-instruction and DRAM-read counters per GPU from CUPTI PM sampling.

    ``lib`` is the ``cupti`` package (imported on first use when ``None``); tests pass a fake.
    ``interval_s`` is the hardware sampling interval. Nothing touches CUPTI until the first
    :meth:`sample_profiling`.
    """

    def __init__(
        self,
        devices: list[GPUIdentity],
        lib: Any | None = None,
        interval_s: float = 0.1,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self._lib = lib
        self._lib_error: SourceUnavailable | None = None
        self._interval_s = interval_s
        self._clock = clock
        self._devices = [_Device(gpu) for gpu in devices]
        self._max_samples = max(64, math.ceil(_DECODE_WINDOW_S / interval_s))
        self._lock = threading.Lock()
        self._closed = False
        self._order_checked = False

    # -- public API -------------------------------------------------------------------------

    def sample_profiling(self) -> list[ProfilingSample]:
        """One sample per GPU with counters summed since the source started.

        GPUs where PM sampling cannot run get a sample with ``None`` fields (absent series).
        Raises SourceUnavailable when it runs on no GPU, HardwareError when a running GPU fails.
        """
        with self._lock:
            if self._closed:
                raise HardwareError("CUPTI PM sampler is closed")
            lib = self._require_lib()
            if not self._devices:
                raise SourceUnavailable("no_gpu", "no GPUs were given to the profiling source")
            self._warn_if_cuda_order_differs()
            errors = self._runtime_errors(lib)
            failures: list[str] = []
            for dev in self._devices:
                if dev.collector is None:
                    failure = self._try_start(lib, dev, errors)
                    if failure:
                        failures.append(failure)
            running = [dev for dev in self._devices if dev.collector is not None]
            if not running and not failures:
                first = self._devices[0]
                raise SourceUnavailable(first.state, first.detail)
            for dev in running:
                try:
                    self._collect(dev)
                except errors as exc:
                    failures.append(self._fail(dev, f"decode failed: {_describe(exc)}"))
                else:
                    # "ok" only once a decode worked, so a GPU that starts but cannot decode
                    # does not flap between states (and log lines) on every call.
                    self._set_state(dev, _OK, f"metrics {dev.sm_metric}, {dev.dram_metric}")
            if failures:
                raise HardwareError("CUPTI PM sampling failed: " + "; ".join(failures))
            # A GPU that is not sampling reports nothing rather than a stale, flat total.
            return [self._sample(dev) for dev in self._devices]

    def status(self) -> tuple[str, str]:
        """``("ok", "")`` when every GPU is sampling, else the first GPU's ``(reason, detail)``.

        Besides the SourceUnavailable reasons the state can be ``not_started`` (before the
        first sample) or ``hardware_error`` (failed at run time, restarted on the next call).
        """
        with self._lock:
            if self._lib_error is not None:
                return (self._lib_error.reason, self._lib_error.detail)
            if not self._devices:
                return ("no_gpu", "no GPUs were given to the profiling source")
            for dev in self._devices:
                if dev.state != _OK:
                    return (dev.state, dev.detail)
            return (_OK, "")

    def close(self) -> None:
        """Stop sampling and release the counters on every GPU. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for dev in self._devices:
                if dev.collector is not None:
                    self._cupti_shutdown(dev.collector)
                    dev.collector = None
                    dev.state, dev.detail = _NOT_STARTED, "closed"

    # -- lifecycle --------------------------------------------------------------------------

    def _require_lib(self) -> Any:
        if self._lib_error is not None:
            # A fresh exception each time: re-raising one instance grows its traceback forever.
            raise SourceUnavailable(self._lib_error.reason, self._lib_error.detail)
        if self._lib is None:
            try:
                # Imported here, never at module import: the package pulls in cuda-bindings and
                # numpy, and most agents never enable this source.
                self._lib = importlib.import_module("cupti")
            except ImportError as exc:
                self._lib_error = SourceUnavailable(
                    "cupti_missing",
                    f"cannot import cupti ({exc}); install mrc-agent[profiling] "
                    "(cupti-python>=13.3)",
                )
        if self._lib is not None and not hasattr(self._lib, "pm_sampling"):
            self._lib_error = SourceUnavailable(
                "cupti_missing", "cupti-python has no pm_sampling module; it needs >= 13.3"
            )
        if self._lib_error is not None:
            log.warning("CUPTI PM sampling unavailable: %s", self._lib_error)
            raise SourceUnavailable(self._lib_error.reason, self._lib_error.detail)
        return self._lib

    def _try_start(self, lib: Any, dev: _Device, errors: tuple[type[BaseException], ...]) -> str:
        """Start sampling on one GPU. Returns a failure message for a transient error."""
        now = self._clock()
        if dev.state in _REASON_CODES and dev.state != "profiler_busy":
            return ""  # does not change while the agent runs; asking again only costs time
        if dev.retry_at is not None and now < dev.retry_at:
            return ""
        collector = None
        try:
            collector = self._cupti_open(lib, dev.gpu.index)
            dev.sm_metric, dev.dram_metric = self._cupti_configure(lib, collector)
            self._cupti_start(collector)
        except SourceUnavailable as exc:
            self._cleanup(collector)
            self._unavailable(dev, exc.reason, exc.detail, now)
            return ""
        except errors as exc:
            self._cleanup(collector)
            reason = _classify(lib, exc)
            if reason is None:
                return self._fail(dev, f"start failed: {_describe(exc)}")
            self._unavailable(dev, reason, _describe(exc), now)
            return ""
        dev.collector = collector
        dev.retry_at = None
        # Totals start at zero only for what is measured; the rest stays an absent series.
        if dev.sm_metric is not None and dev.sm_total is None:
            dev.sm_total = 0.0
        if dev.dram_metric is not None and dev.dram_total is None:
            dev.dram_total = 0.0
        return ""

    def _collect(self, dev: _Device) -> None:
        """Decode completed intervals into the GPU's totals, emptying the hardware buffer."""
        for _ in range(_MAX_DECODE_ROUNDS):
            rows = self._cupti_decode(dev.collector, dev.sm_metric, dev.dram_metric)
            for sm_value, dram_value in rows:
                # Added as they come, so a decode that fails later loses nothing already read.
                if dev.sm_total is not None:
                    dev.sm_total += _count(sm_value)
                if dev.dram_total is not None:
                    dev.dram_total += _count(dram_value)
            if len(rows) < self._max_samples:
                return

    def _fail(self, dev: _Device, message: str) -> str:
        """A GPU failed at run time: release it so the next call starts it afresh."""
        self._cleanup(dev.collector)
        dev.collector = None
        text = f"GPU {dev.gpu.index}: {message}"
        self._set_state(dev, _HARDWARE_ERROR, text)
        return text

    def _unavailable(self, dev: _Device, reason: str, detail: str, now: float) -> None:
        dev.retry_at = now + BUSY_RETRY_S if reason == "profiler_busy" else None
        self._set_state(dev, reason, detail)

    def _set_state(self, dev: _Device, state: str, detail: str) -> None:
        """Record a GPU's state, logging only when it changes, never per sample."""
        changed = state != dev.state
        dev.state, dev.detail = state, detail
        if not changed:
            return
        if state == _OK:
            log.info("CUPTI PM sampling started on GPU %d: %s", dev.gpu.index, detail)
        else:
            log.warning("CUPTI PM sampling on GPU %d: %s (%s)", dev.gpu.index, state, detail)

    @staticmethod
    def _sample(dev: _Device) -> ProfilingSample:
        if dev.collector is None:
            return ProfilingSample(gpu=dev.gpu)
        return ProfilingSample(
            gpu=dev.gpu,
            sm_instructions_executed_total=dev.sm_total,
            dram_read_bytes_total=dev.dram_total,
        )

    def _cleanup(self, collector: Any) -> None:
        if collector is not None:
            self._cupti_shutdown(collector)

    def _runtime_errors(self, lib: Any) -> tuple[type[BaseException], ...]:
        # What cupti.pm_sampling raises (its docstrings): cuptiError for CUPTI codes it does not
        # translate, and MemoryError / PermissionError / RuntimeError / ValueError for those it
        # does. Anything else is a bug here and should surface as one.
        return (lib.cupti.cuptiError, MemoryError, RuntimeError, ValueError, OSError)

    def _warn_if_cuda_order_differs(self) -> None:
        if self._order_checked:
            return
        self._order_checked = True
        if len(self._devices) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            log.warning(
                "CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA device indices used by CUPTI may not "
                "match NVML's, so profiling counters could carry another GPU's labels"
            )
        if os.environ.get("CUDA_VISIBLE_DEVICES"):
            log.warning(
                "CUDA_VISIBLE_DEVICES is set: CUPTI device indices are renumbered and may not "
                "match NVML's"
            )

    # -- the CUPTI boundary: the only methods that call the library -----------------------------

    def _cupti_open(self, lib: Any, index: int) -> Any:
        collector = lib.pm_sampling.Collector(device_index=index)
        collector.enable()
        return collector

    def _cupti_configure(self, lib: Any, collector: Any) -> tuple[str | None, str | None]:
        """Configure the most preferred metric pair this GPU accepts; returns the names used.

        ``configure()`` raises ValueError both for a metric the chip's PM sampling cannot
        collect and for an unsupported trigger mode, so both are handled by trying the next
        combination. GPU_TIME_INTERVAL (nanoseconds) is not supported on Turing and GA100;
        there the interval falls back to GPU_SYSCLK_INTERVAL, counted in SYSCLK cycles, which
        makes the interval approximate but leaves the summed counts exact.
        """
        trigger = lib.pm_sampling.TriggerMode
        interval = max(1, round(self._interval_s * 1e9))
        last_error = ""
        for mode in (trigger.GPU_TIME_INTERVAL, trigger.GPU_SYSCLK_INTERVAL):
            for sm_metric, dram_metric in _metric_choices():
                metrics = [m for m in (sm_metric, dram_metric) if m is not None]
                try:
                    collector.configure(
                        metrics=metrics,
                        hardware_buffer_size=HARDWARE_BUFFER_BYTES,
                        sampling_interval=interval,
                        trigger_mode=mode,
                    )
                except ValueError as exc:
                    last_error = str(exc)
                    continue
                return sm_metric, dram_metric
        raise SourceUnavailable(
            "unsupported_device",
            f"PM sampling accepts none of {SM_INSTRUCTION_METRICS + DRAM_READ_METRICS}: "
            f"{last_error}",
        )

    def _cupti_start(self, collector: Any) -> None:
        collector.start()

    def _cupti_decode(
        self, collector: Any, sm_metric: str | None, dram_metric: str | None
    ) -> list[tuple[float | None, float | None]]:
        """Completed intervals since the last decode, as ``(sm, dram)`` counts per interval."""
        data = collector.decode(max_samples=self._max_samples)
        names = list(data.metrics)
        sm_at = names.index(sm_metric) if sm_metric is not None else None
        dram_at = names.index(dram_metric) if dram_metric is not None else None
        rows: list[tuple[float | None, float | None]] = []
        for sample in data:  # evaluates each completed sample on the host
            values = sample.metric_values
            rows.append(
                (
                    values[sm_at] if sm_at is not None else None,
                    values[dram_at] if dram_at is not None else None,
                )
            )
        return rows

    def _cupti_shutdown(self, collector: Any) -> None:
        """Stop and disable, each on its own: stop() raises when sampling never started."""
        for step in ("stop", "disable"):
            try:
                getattr(collector, step)()
            except Exception as exc:  # teardown must reach disable() whatever stop() raised
                log.debug("CUPTI PM sampling %s() during teardown: %s", step, _describe(exc))


def _metric_choices() -> list[tuple[str | None, str | None]]:
    """Metric pairs in order of preference: both counters first, then either one alone."""
    pairs: list[tuple[str | None, str | None]] = list(
        product(SM_INSTRUCTION_METRICS, DRAM_READ_METRICS)
    )
    pairs += [(sm, None) for sm in SM_INSTRUCTION_METRICS]
    pairs += [(None, dram) for dram in DRAM_READ_METRICS]
    return pairs


def _classify(lib: Any, exc: BaseException) -> str | None:
    """The bounded reason a start-up error means, or ``None`` when it may be transient."""
    if isinstance(exc, lib.cupti.cuptiError):
        return _REASON_BY_RESULT.get(_result_name(lib, getattr(exc, "status", None)))
    # cupti.pm_sampling translates some codes into builtin exceptions (Collector.enable):
    # INSUFFICIENT_PRIVILEGES -> PermissionError, INVALID_PARAMETER on the device index ->
    # ValueError, INVALID_OPERATION ("already enabled") and nvperf load failures -> RuntimeError.
    if isinstance(exc, PermissionError):
        return "no_permission"
    if isinstance(exc, ValueError):
        return "no_gpu"
    if isinstance(exc, RuntimeError):
        name, text = type(exc).__name__, str(exc)
        if name in _MISSING_LIBRARY_ERRORS or "nvperf" in text:
            return "cupti_missing"
        if name == "NotSupportedError":  # cupti-python: "CUDA driver is not found (...)"
            return "no_gpu" if "not found" in text else "unsupported_device"
        if "already enabled" in text:  # someone else in this process holds PM sampling
            return "profiler_busy"
    return None


def _result_name(lib: Any, status: Any) -> str:
    try:
        return str(lib.cupti.Result(status).name)
    except (TypeError, ValueError):
        return str(status)


def _count(value: float | None) -> float:
    """A per-interval count as a non-negative finite number, so totals never go down."""
    if value is None:
        return 0.0
    number = float(value)
    return number if math.isfinite(number) and number > 0 else 0.0


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
