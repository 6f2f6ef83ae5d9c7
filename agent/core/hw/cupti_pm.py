"""Opt-in profiling-counter source: true SM-instruction and DRAM-read counters via CUPTI PM
sampling (``cupti-python`` >= 13.3, ``cupti.pm_sampling``).

PM sampling programs the GPU's performance monitors to snapshot the chosen counters every
``interval_s`` into a hardware buffer; :meth:`CuptiPmSampler.sample_profiling` decodes whatever
intervals completed since the last call and adds them to running totals, so the collectors get
cumulative counters and ``rate()`` does the maths. The counters are device-wide, so a sidecar
process sees the inference service's kernels. Where the chip's single-pass set has no DRAM
byte counter, only a read-throughput percentage, that becomes a 0-1 ratio of peak (the mean
over the intervals decoded by the call), never a byte count. Which metrics: ``cupti_metrics``.

The call sequence is the one ``cupti.pm_sampling.Collector`` documents and NVIDIA's sample
``cupti-python-samples/CuptiPmSamplingVectorAddNumba.py`` uses, after ``cuInit(0)``
(``cuda_driver``; without it CUPTI answers ``ERROR_NOT_INITIALIZED``):
``Collector(device_index) -> enable() -> configure(metrics=...) -> start() -> decode()* ->
stop() -> disable()``. Everything that touches CUPTI sits in the few ``_cupti_*`` methods so a
hand-written fake (``agent/tools/simgpu/cupti.py``) can stand in for the library. If ``enable()``
still answers "not initialised" after ``cuInit``, the device's primary context is retained and
``enable()`` tried once more; that context costs device memory (a few hundred MiB on recent
GPUs, to be measured on the hardware check) and is held only where it was needed.

Profiler lifetime is per process, not per collector: ``Collector.disable()`` ends in
``cuptiProfilerDeInitialize``, which is process-wide, and so does ``enable()``'s rollback when
it fails after its own ``cuptiProfilerInitialize`` (and so does dropping an enabled Collector:
its finalizer disables it). Whether CUPTI counts initialise/deinitialise calls is stated
neither in cupti-python's sources nor in CUPTI's API reference; if it does not, any
deinitialise tears down every GPU. So no collector is disabled beside one that stays enabled.
A GPU that fails at run time is stopped and restarted with ``configure() + start()`` on the
same enabled collector. A collector no longer needed (its GPU left the pod's scope, its metrics
never configure, its start was refused for a reason that does not change) is released by a
*cycle* (:meth:`CuptiPmSampler._cycle`): every running GPU is decoded and stopped, every
collector disabled, the unneeded GPUs' primary contexts released, and the GPUs still wanted
enabled and started again in the same pass, their totals carrying on: right under either
answer, at the cost of the intervals between that decode and the restart. Enables run before
any start in a pass, so on the first pass a failing ``enable()`` cannot interrupt a GPU
already sampling. A later retry of a failed ``enable()`` (another profiler held that GPU) does
run beside sampling GPUs; that it leaves them sampling is to be checked on a multi-GPU host.

**Which GPUs.** PM sampling holds a GPU's performance monitors, shutting every other profiler
(a neighbour pod's agent, DCGM profiling, Nsight) out of it, so only the pod's GPUs are profiled
(:meth:`CuptiPmSampler.sample_profiling_for`, fed the attribution decision every pass). CUPTI
numbers GPUs as CUDA does, which is NVML's order only by luck (``CUDA_VISIBLE_DEVICES``, a GPU
CUDA skips, MIG, fastest-first ordering): each GPU's CUDA ordinal is found by its UUID
(:meth:`CudaDriver.ordinals`), and a GPU this process's CUDA does not see is ``no_cuda_device``.

Failures before sampling runs become :class:`SourceUnavailable` with a bounded reason
(``cupti_reasons.REASON_CODES``). Failures after a successful start, and starts that may work
later, become :class:`HardwareError`; the GPU is then retried with an exponential backoff
(:data:`BACKOFF_INITIAL_S` doubling to :data:`BACKOFF_MAX_S`, reset by a good decode) and its
totals carry on from where they were. A busy GPU is retried after :data:`BUSY_RETRY_S`. A
TypeError or AttributeError from the binding (a cupti-python whose API changed) is the reason
``binding_mismatch`` wherever it comes, decode included: said once, not retried until restart.
"""

from __future__ import annotations

import importlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mrc_agent.agent.core.hw.base import (
    GPUIdentity,
    HardwareError,
    ProfilingSample,
    ProfilingScope,
    ScopeOf,
    SourceUnavailable,
    finite,
    ratio_of_percent,
)
from mrc_agent.agent.core.hw.cuda_driver import LIBCUDA_MISSING, CudaDriver
from mrc_agent.agent.core.hw.cupti_metrics import (
    DRAM_COUNT_METRICS,
    DRAM_READ_METRICS,
    DRAM_THROUGHPUT_METRICS,
    PROFILING_METRICS,
    SM_INSTRUCTION_METRICS,
    MetricChoice,
    choices_from_sets,
    ordered_choices,
    query_sets,
    unit_lookup,
    with_unit,
)
from mrc_agent.agent.core.hw.cupti_reasons import REASON_CODES as _REASON_CODES
from mrc_agent.agent.core.hw.cupti_reasons import classify as _classify
from mrc_agent.agent.core.hw.cupti_reasons import describe as _describe
from mrc_agent.agent.core.hw.cupti_reasons import not_initialised as _not_initialised
from mrc_agent.agent.core.hw.cupti_reasons import runtime_errors as _runtime_errors
from mrc_agent.agent.core.hw.cupti_timeline import ActivityTimeline, Row, decode_rows
from mrc_agent.agent.core.hw.nvml.device import default_sample_clocks

__all__ = [
    "BACKOFF_INITIAL_S",
    "BACKOFF_MAX_S",
    "BUSY_RETRY_S",
    "DRAM_COUNT_METRICS",
    "DRAM_READ_METRICS",
    "DRAM_THROUGHPUT_METRICS",
    "HARDWARE_BUFFER_BYTES",
    "PROFILING_METRICS",
    "SM_INSTRUCTION_METRICS",
    "CuptiPmSampler",
]

log = logging.getLogger(__name__)

#: Raw-record buffer CUPTI fills between decodes. The library default (512 MiB) is sized for
#: microsecond intervals; the agent samples at 50 Hz (20 ms) and must not take memory from the
#: service it watches. The size of one record is not documented, so this is to be checked on a
#: GPU (an overflow shows up as a HardwareError from decode).
HARDWARE_BUFFER_BYTES = 32 * 1024 * 1024

#: Another profiler (Nsight, DCGM profiling) usually holds the counters only for a while, so a
#: busy device is tried again after this long instead of being given up for good.
BUSY_RETRY_S = 60.0

#: A start that failed in a way that may pass is retried after this long, doubling per failure
#: up to BACKOFF_MAX_S: soon enough to catch a blip, rare enough that a GPU which keeps failing
#: does not run enable/configure/start on every tick.
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 300.0

#: Decoded samples reserved per decode: room for this many seconds of intervals, so one decode
#: per scrape normally empties the hardware buffer.
_DECODE_WINDOW_S = 30.0

#: When a decode comes back full, records are still waiting; decode again, at most this often.
_MAX_DECODE_ROUNDS = 8

#: States a device can be in besides the reasons above.
_NOT_STARTED = "not_started"
_OK = "ok"
_HARDWARE_ERROR = "hardware_error"


@dataclass
class _Device:
    """Per-GPU sampling state. Totals stay ``None`` until a metric for them is configured."""

    gpu: GPUIdentity
    timeline: ActivityTimeline = field(repr=False)
    #: The CUDA ordinal CUPTI numbers this GPU by (found by UUID); None until enabled once.
    ordinal: int | None = None
    #: The enabled Collector; disabled only as :meth:`CuptiPmSampler._cycle` says.
    collector: Any = None
    running: bool = False
    choice: MetricChoice | None = None
    trigger_mode: Any = None
    logged_choice: MetricChoice | None = None
    sm_total: float | None = None
    dram_total: float | None = None
    dram_ratio: float | None = None
    #: The throughput ratio decoded just before a cycle restarted this GPU, kept for the pass.
    cycled_ratio: float | None = None
    state: str = _NOT_STARTED
    detail: str = ""
    retry_at: float | None = None
    #: Consecutive failed starts (or runs), for the backoff; reset by a good decode.
    failures: int = 0


class CuptiPmSampler:
    """Cumulative SM-instruction and DRAM-read counters per GPU from CUPTI PM sampling.

    ``devices`` are the GPUs it may profile (physical GPUs, NVML's identities). ``lib`` is the
    ``cupti`` package (imported on first use when ``None``); tests pass a fake. ``cuda`` is the
    CUDA driver boundary (:class:`CudaDriver`); when ``None`` it is the real one if ``lib`` is
    ``None`` too, and no driver calls at all when only a stand-in ``lib`` is given (then CUDA's
    ordinal is taken to be NVML's index: the stand-in numbers devices that way).
    ``interval_s`` is the hardware sampling interval; ``sample_clocks`` the clocks its sample
    stamps may be on (``cupti_timeline``). ``profile_undecided`` lets
    :meth:`sample_profiling_for` profile every GPU while the attribution is undecided on a node
    of several. Nothing touches CUDA or CUPTI until the first sample.
    """

    def __init__(
        self,
        devices: list[GPUIdentity],
        lib: Any | None = None,
        interval_s: float = 0.1,
        *,
        clock: Callable[[], float] = time.monotonic,
        sample_clocks: dict[str, Callable[[], float]] | None = None,
        cuda: CudaDriver | None = None,
        profile_undecided: bool = False,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self._lib = lib
        self._lib_error: SourceUnavailable | None = None
        self._cuda = cuda if cuda is not None or lib is not None else CudaDriver()
        self._cuda_error: SourceUnavailable | None = None
        self._interval_s = interval_s
        self._clock = clock
        stamps = sample_clocks or default_sample_clocks(time.time)
        self._devices = [_Device(gpu, ActivityTimeline(f"GPU {gpu.index}", clock, stamps))
                         for gpu in devices]
        #: The GPUs profiled now: every one until a scope says otherwise.
        self._watched = list(self._devices)
        #: Why no GPU is profiled under the current scope (attribution_unknown, no_gpu).
        self._scope_error: SourceUnavailable | None = None
        self._profile_undecided = profile_undecided
        self._max_samples = max(64, math.ceil(_DECODE_WINDOW_S / interval_s))
        self._lock = threading.Lock()
        self._closed = False

    # -- public API -------------------------------------------------------------------------

    def sample_profiling(self) -> list[ProfilingSample]:
        """One sample per watched GPU (every GPU given, unless a scope narrowed them) with
        counters summed since the source started.

        GPUs where PM sampling is not running get a sample with ``None`` fields (absent
        series). Raises SourceUnavailable when it runs on no GPU for good, HardwareError when a
        GPU failed this call or every GPU that could run is waiting to be retried.
        """
        with self._lock:
            return self._sample_pass()

    def sample_profiling_for(self, scope_of: ScopeOf) -> list[ProfilingSample]:
        """As :meth:`sample_profiling`, for the GPUs of ``scope_of``'s answer (the pod's): a GPU
        that joins is started, one that leaves is stopped and released. While no target says
        which GPUs are its own, a node of several GPUs is not profiled (``attribution_unknown``)
        unless ``profile_undecided``; a node of one is (it can only be the pod's)."""
        with self._lock:
            if not self._closed:
                self._rescope(scope_of([dev.gpu for dev in self._devices]))
            return self._sample_pass()

    def status(self) -> tuple[str, str]:
        """``("ok", "")`` when every watched GPU is sampling, else the scope's reason or the
        first GPU's ``(reason, detail)``.

        Besides the SourceUnavailable reasons the state can be ``not_started`` (before the
        first sample) or ``hardware_error`` (failed; retried after a backoff).
        """
        with self._lock:
            if self._lib_error is not None:
                return (self._lib_error.reason, self._lib_error.detail)
            if self._scope_error is not None:
                return (self._scope_error.reason, self._scope_error.detail)
            if not self._devices:
                return ("no_gpu", "no GPUs were given to the profiling source")
            for dev in self._watched:
                if dev.state != _OK:
                    return (dev.state, dev.detail)
            return (_OK, "")

    def close(self) -> None:
        """Stop sampling, disable every collector, release any primary context. Safe twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cycle(keep=False)
            for dev in self._devices:
                dev.state, dev.detail = _NOT_STARTED, "closed"
            if self._cuda is not None:
                self._cuda.close()

    # -- scope and release ------------------------------------------------------------------

    def _rescope(self, scope: ProfilingScope) -> None:
        """Watch the GPUs of ``scope``; the ones that left are released by the next pass."""
        error: SourceUnavailable | None
        if scope.undecided and len(self._devices) > 1 and not self._profile_undecided:
            watched: list[_Device] = []
            error = SourceUnavailable(
                "attribution_unknown",
                f"no target says which of the {len(self._devices)} GPUs it uses; PM sampling "
                "on all of them would hold the neighbours' performance monitors (the "
                "profile_unattributed setting allows it)")
        else:
            watched = [dev for dev in self._devices if dev.gpu in scope.gpus]
            error = None if watched else SourceUnavailable(
                "no_gpu", "the targets use none of the GPUs PM sampling can profile here")
        before = self._scope_error.reason if self._scope_error else ""
        if [d.gpu for d in watched] != [d.gpu for d in self._watched] or (
                (error.reason if error else "") != before):
            shown = ", ".join(str(d.gpu.index) for d in watched) or "none"
            log.info("CUPTI PM sampling profiles GPU(s) %s%s", shown,
                     f" ({error.reason}: {error.detail})" if error else "")
        self._watched, self._scope_error = watched, error

    def _unneeded(self, dev: _Device) -> bool:
        """Holds a collector it will not use: not watched, or stuck for good (metrics that
        never configure, a start refused for a reason that does not change)."""
        if dev.collector is None:
            return False
        stuck = dev.state in _REASON_CODES and dev.state != "profiler_busy"
        return stuck or dev not in self._watched

    def _cycle(self, keep: bool = True) -> None:
        """Release every collector in the one order that is safe whether or not CUPTI counts
        profiler initialisations (module docstring): decode and stop every running GPU, then
        disable every collector, then release the primary contexts of the GPUs not kept. With
        ``keep`` the watched GPUs that were running or enabled are due again at once, so the
        same pass re-enables and restarts them, their totals carrying on."""
        restart, was_running = [], []
        for dev in self._devices:
            if dev.running:
                was_running.append(dev)
                try:
                    self._collect(dev)  # what it counted so far is kept
                    dev.cycled_ratio = dev.dram_ratio
                except Exception as exc:  # a GPU that cannot decode loses only this window
                    log.debug("CUPTI PM sampling decode before a release: %s", _describe(exc))
                self._cupti_stop(dev.collector)
                dev.running = False
        for dev in self._devices:
            if dev.collector is None:
                continue
            if keep and not self._unneeded(dev):
                restart.append(dev)
            self._cupti_disable(dev.collector)
            dev.collector = None
        for dev in self._devices:
            if self._cuda is not None and dev.ordinal is not None and dev not in restart:
                self._cuda.release_primary_context(dev.ordinal)
        for dev in restart:
            if dev in was_running:  # a GPU waiting out a backoff keeps waiting
                dev.retry_at = None
        if restart:
            log.info("CUPTI PM sampling re-enables GPU(s) %s after releasing another GPU",
                     ", ".join(str(d.gpu.index) for d in restart))

    # -- one pass ---------------------------------------------------------------------------

    def _sample_pass(self) -> list[ProfilingSample]:
        if self._closed:
            raise HardwareError("CUPTI PM sampling is closed")
        lib = self._require_lib()
        if not self._devices:
            raise SourceUnavailable("no_gpu", "no GPUs were given to the profiling source")
        errors = _runtime_errors(lib)
        now = self._clock()
        if any(self._unneeded(dev) for dev in self._devices):
            self._cycle()  # GPUs that left the scope: before any start of this pass
        if self._scope_error is not None:
            raise SourceUnavailable(self._scope_error.reason, self._scope_error.detail)
        failures = self._bring_up(lib, errors, now)
        if any(self._unneeded(dev) for dev in self._devices):
            self._cycle()  # frees the GPUs refused for good; the rest restart this pass
            failures += self._bring_up(lib, errors, now)
        failures = [f for f in failures if f]
        running = [dev for dev in self._watched if dev.running]
        if not running and not failures:
            waiting = [dev for dev in self._watched if dev.state == _HARDWARE_ERROR]
            if waiting:
                raise HardwareError(
                    "CUPTI PM sampling waits to retry: " + "; ".join(dev.detail for dev in waiting)
                )
            first = self._watched[0]
            raise SourceUnavailable(first.state, first.detail)
        for dev in running:
            try:
                self._collect(dev)
            except errors as exc:
                failures.append(self._fail_run(dev, f"decode failed: {_describe(exc)}", now))
                if _classify(lib, exc) == "binding_mismatch":  # for good: released next pass
                    self._unavailable(dev, "binding_mismatch", f"decode: {_describe(exc)}", now)
            else:
                # "ok" only once a decode worked, so a GPU that starts but cannot decode
                # does not flap between states (and log lines) on every call.
                dev.failures = 0
                self._set_state(dev, _OK, dev.choice.describe() if dev.choice else "")
            if dev.dram_ratio is None:
                dev.dram_ratio = dev.cycled_ratio
            dev.cycled_ratio = None
        if failures:
            raise HardwareError("CUPTI PM sampling failed: " + "; ".join(failures))
        return [self._sample(dev) for dev in self._watched]

    def _bring_up(
        self, lib: Any, errors: tuple[type[BaseException], ...], now: float
    ) -> list[str]:
        """Every due enable first, then the starts: a failing enable() deinitialises the
        profiler process-wide (module docstring), so it must not come between a GPU's start
        and its sampling on the first pass."""
        failures = []
        for dev in self._watched:
            if dev.collector is None and self._due(dev, now):
                failures.append(self._try_enable(lib, dev, errors, now))
        for dev in self._watched:
            if dev.collector is not None and not dev.running and self._due(dev, now):
                failures.append(self._try_start(lib, dev, errors, now))
        return failures

    def _ordinal(self, dev: _Device) -> int | None:
        """The CUDA ordinal of ``dev``'s GPU: the device whose UUID is its UUID (None: CUDA
        in this process has no such device). Raises as :meth:`CudaDriver.ordinals` does."""
        if self._cuda is None:
            return dev.gpu.index  # a stand-in library numbers its devices as NVML does
        by_uuid = {uuid.lower(): ordinal for uuid, ordinal in self._cuda.ordinals().items()}
        ordinal = by_uuid.get(dev.gpu.uuid.lower())
        if ordinal is not None and ordinal != dev.gpu.index and dev.ordinal is None:
            log.info("GPU %d (%s) is CUDA device %d for CUPTI", dev.gpu.index, dev.gpu.uuid,
                     ordinal)
        return ordinal

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

    def _require_cuda(self) -> None:
        """``cuInit`` once per process (``CudaDriver.init`` is idempotent). SourceUnavailable is
        for good (CUDA keeps a failed initialisation's answer); HardwareError may pass and is
        retried with the backoff."""
        if self._cuda is None:
            return
        if self._cuda_error is not None:
            raise SourceUnavailable(self._cuda_error.reason, self._cuda_error.detail)
        try:
            self._cuda.init()
        except SourceUnavailable as exc:
            self._cuda_error = exc
            raise SourceUnavailable(exc.reason, exc.detail) from None

    @staticmethod
    def _due(dev: _Device, now: float) -> bool:
        """Whether a GPU that is not sampling should be tried now."""
        if dev.state in _REASON_CODES and dev.state != "profiler_busy":
            return False  # does not change while the agent runs; asking again only costs time
        return dev.retry_at is None or now >= dev.retry_at

    def _try_enable(
        self, lib: Any, dev: _Device, errors: tuple[type[BaseException], ...], now: float
    ) -> str:
        """Enable PM sampling on one GPU. Returns a failure message for a transient error."""
        try:
            self._require_cuda()
            ordinal = self._ordinal(dev)
            if ordinal is None:
                self._unavailable(
                    dev, "no_cuda_device",
                    f"no CUDA device of this process has UUID {dev.gpu.uuid} (hidden by "
                    "CUDA_VISIBLE_DEVICES, or in MIG mode)", now)
                return ""
            dev.ordinal = ordinal
            dev.collector = self._cupti_enable(lib, ordinal, errors)
        except SourceUnavailable as exc:
            self._unavailable(dev, exc.reason, exc.detail, now)
        except HardwareError as exc:
            return self._fail_start(dev, f"CUDA initialisation failed: {exc}", now)
        except errors as exc:
            reason = _classify(lib, exc)
            if reason is None:
                return self._fail_start(dev, f"enable failed: {_describe(exc)}", now)
            detail = _describe(exc)
            if reason == "cuda_missing":
                detail = f"{LIBCUDA_MISSING} ({detail})"
            self._unavailable(dev, reason, detail, now)
        return ""

    def _try_start(
        self, lib: Any, dev: _Device, errors: tuple[type[BaseException], ...], now: float
    ) -> str:
        """Configure and start an enabled GPU (also the restart after a run-time failure)."""
        try:
            choice = self._cupti_configure(lib, dev, errors)
            self._cupti_start(dev.collector)
        except SourceUnavailable as exc:
            self._unavailable(dev, exc.reason, exc.detail, now)
            return ""
        except errors as exc:
            reason = _classify(lib, exc)
            if reason is None:
                return self._fail_start(dev, f"start failed: {_describe(exc)}", now)
            self._unavailable(dev, reason, _describe(exc), now)
            return ""
        dev.running = True
        # Totals start at zero only for what is measured; the rest stays an absent series.
        if choice.sm_metric is not None and dev.sm_total is None:
            dev.sm_total = 0.0
        if choice.dram_metric is not None and not choice.dram_is_ratio and dev.dram_total is None:
            dev.dram_total = 0.0
        if choice != dev.logged_choice:
            dev.logged_choice = choice
            log.info("CUPTI PM sampling on GPU %d configured: %s", dev.gpu.index, choice.describe())
        return ""

    def _collect(self, dev: _Device) -> None:
        """Decode completed intervals into the GPU's totals, emptying the hardware buffer."""
        choice = dev.choice
        dev.dram_ratio = None
        if choice is None:
            return
        ratios: list[float] = []
        for _ in range(_MAX_DECODE_ROUNDS):
            rows = self._cupti_decode(
                dev.collector, (choice.sm_metric, choice.dram_metric, choice.active_metric))
            if choice.active_metric is not None:
                dev.timeline.add((stamp, values[2]) for values, stamp in rows)
            for (sm_value, dram_value, _), _ in rows:
                # Added as they come, so a decode that fails later loses nothing already read.
                if dev.sm_total is not None:
                    dev.sm_total += _count(sm_value)
                if choice.dram_is_ratio:
                    fraction = ratio_of_percent(dram_value)
                    if fraction is not None:
                        ratios.append(fraction)
                elif dev.dram_total is not None:  # sectors count 32 bytes (cupti_metrics)
                    dev.dram_total += _count(dram_value) * (choice.dram_bytes_per_unit or 1)
            if len(rows) < self._max_samples:
                break
        if ratios:
            dev.dram_ratio = sum(ratios) / len(ratios)

    def _fail_run(self, dev: _Device, message: str, now: float) -> str:
        """A GPU failed at run time: stop it (never disable, see the module docstring) and
        restart it with configure() + start() once its backoff has passed."""
        self._cupti_stop(dev.collector)
        dev.running = False
        return self._fail_start(dev, message, now)

    def _fail_start(self, dev: _Device, message: str, now: float) -> str:
        dev.failures += 1
        delay = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2.0 ** min(dev.failures - 1, 30))
        dev.retry_at = now + delay
        text = f"GPU {dev.gpu.index}: {message} (retry in {delay:g} s)"
        self._set_state(dev, _HARDWARE_ERROR, text)
        return text

    def _unavailable(self, dev: _Device, reason: str, detail: str, now: float) -> None:
        # Only a busy GPU is ever tried again (_due); for the other reasons this is unused.
        dev.retry_at = now + BUSY_RETRY_S
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
        choice = dev.choice
        if not dev.running or choice is None:
            return ProfilingSample(gpu=dev.gpu)
        return ProfilingSample(
            gpu=dev.gpu,
            sm_instructions_executed_total=dev.sm_total,
            # A total kept from a byte counter configured before a restart is not exported
            # once the GPU measures a throughput percentage instead.
            dram_read_bytes_total=None if choice.dram_is_ratio else dev.dram_total,
            dram_read_throughput_ratio=dev.dram_ratio,  # None unless dram_is_ratio (_collect)
            sm_metric=choice.sm_metric, dram_metric=choice.dram_metric,
            metric_set=choice.metric_set, dram_unit=choice.dram_unit,
            dram_unit_basis=choice.dram_unit_basis,
            activity_points=dev.timeline.take(), activity_metric=choice.active_metric,
            activity_clock=dev.timeline.stamp_clock if choice.active_metric else None,
        )

    # -- the CUPTI boundary: the only methods that call the library -----------------------------

    def _cupti_enable(self, lib: Any, index: int, errors: tuple[type[BaseException], ...]) -> Any:
        """An enabled Collector; retries once with the primary context where CUPTI says the
        CUDA driver is not initialised even after cuInit."""
        collector = lib.pm_sampling.Collector(device_index=index)
        try:
            collector.enable()
        except errors as exc:
            if self._cuda is None or not _not_initialised(lib, exc):
                raise
            log.info(
                "CUPTI PM sampling on CUDA device %d: enable() answered %s after cuInit; retrying "
                "with the device's primary context (it holds device memory)",
                index, _describe(exc),
            )
            self._cuda.retain_primary_context(index)
            try:
                collector.enable()
            except errors:
                # It did not help: give the memory back rather than hold it for nothing.
                self._cuda.release_primary_context(index)
                raise
        return collector

    def _cupti_configure(
        self, lib: Any, dev: _Device, errors: tuple[type[BaseException], ...]
    ) -> MetricChoice:
        """Configure the best metrics this GPU accepts; returns (and keeps) the choice.

        A restart reuses the configuration that worked. Otherwise the pair chosen from the
        chip's single-pass sets comes first, then every name combination in order.
        ``configure()`` raises ValueError both for metrics it cannot collect in one pass and
        for an unsupported trigger mode, so both are handled by trying the next combination.
        GPU_TIME_INTERVAL (nanoseconds) is not supported on Turing and GA100; there the
        interval falls back to GPU_SYSCLK_INTERVAL, counted in SYSCLK cycles, which makes the
        interval approximate but leaves the summed counts exact.
        """
        last_error = ""
        for choice, mode in self._candidates(lib, dev, errors):
            try:
                self._cupti_set_config(dev.collector, choice, mode)
            except ValueError as exc:
                last_error = str(exc)
                continue
            dev.choice, dev.trigger_mode = choice, mode
            return choice
        wanted = SM_INSTRUCTION_METRICS + DRAM_COUNT_METRICS + DRAM_THROUGHPUT_METRICS
        raise SourceUnavailable(
            "unsupported_device", f"PM sampling accepts none of {wanted}: {last_error}"
        )

    def _candidates(
        self, lib: Any, dev: _Device, errors: tuple[type[BaseException], ...]
    ) -> Iterator[tuple[MetricChoice, Any]]:
        """(choice, trigger mode) in the order to try; lazy, so a restart whose old
        configuration still works does not query the chip's sets again."""
        if dev.choice is not None:  # set together with trigger_mode
            yield dev.choice, dev.trigger_mode
        trigger = lib.pm_sampling.TriggerMode
        modes = (trigger.GPU_TIME_INTERVAL, trigger.GPU_SYSCLK_INTERVAL)
        chip = getattr(dev.collector, "_chip_name", None)  # set by Collector.enable()
        sets = query_sets(lib, chip, errors) if isinstance(chip, str) and chip else None
        from_sets = choices_from_sets(sets) if sets else []
        units = unit_lookup(lib, chip, errors) if isinstance(chip, str) and chip else None
        for choice, mode in ordered_choices(from_sets, modes):  # pairs before one metric
            resolved = with_unit(choice, units)
            if resolved is not None:
                yield resolved, mode

    def _cupti_set_config(self, collector: Any, choice: MetricChoice, mode: Any) -> None:
        options: dict[str, Any] = {}
        if choice.metric_set is not None:
            options["single_pass_metric_set_name"] = choice.metric_set
        collector.configure(
            metrics=choice.metrics,
            hardware_buffer_size=HARDWARE_BUFFER_BYTES,
            sampling_interval=max(1, round(self._interval_s * 1e9)),
            trigger_mode=mode,
            **options,
        )

    def _cupti_start(self, collector: Any) -> None:
        collector.start()

    def _cupti_decode(self, collector: Any, metrics: Sequence[str | None]) -> list[Row]:
        """Completed intervals since the last decode: each one's values of ``metrics``, in
        that order (``None`` for a name not configured), and its end stamp."""
        return decode_rows(collector.decode(max_samples=self._max_samples), metrics)

    def _cupti_stop(self, collector: Any) -> None:
        """Stop sampling, whatever state it is in: stop() raises when it was not running."""
        try:
            collector.stop()
        except Exception as exc:  # a failing GPU's stop() may fail too; the restart decides
            log.debug("CUPTI PM sampling stop() after a failure: %s", _describe(exc))

    def _cupti_disable(self, collector: Any) -> None:
        """Disable (in a cycle or at close); a failure is logged, it must not keep the others
        enabled."""
        try:
            collector.disable()
        except Exception as exc:  # teardown must reach every collector
            log.debug("CUPTI PM sampling disable(): %s", _describe(exc))


def _count(value: float | None) -> float:
    """A per-interval count as a non-negative finite number, so totals never go down."""
    number = finite(value)
    return number if number is not None and number > 0 else 0.0
