"""The NVML session: the library, init and teardown, and NVML's errors in the project's terms.

Three things every other part of the adapter stands on:

* :class:`Gpu`, one GPU as the current NVML session sees it. Its handle, and everything set up
  through it (event set, GPM buffers, discovered links), dies with the session;
* :class:`Memo`, what outlives sessions and is shared with the PCIe thread: the queries each
  GPU answered NOT_SUPPORTED (never retried, the field stays ``None``) and the messages already
  logged (each logged once);
* :class:`NvmlSession`, which imports ``pynvml`` lazily, initialises NVML, opens the GPUs, and
  translates an ``NVMLError`` into :class:`~mrc_agent.agent.core.hw.base.SourceUnavailable` (the
  source does not apply here) or :class:`~mrc_agent.agent.core.hw.base.HardwareError` (it failed
  now). After a failure the next call shuts NVML down, initialises it again and fetches fresh
  handles, so the collector recovers on its own when NVML answers again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mrc_agent.agent.core.hw.base import GpmSample, GPUIdentity, HardwareError, SourceUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The NVML_VALUE_TYPE_* constants and the nvmlValue_t member each is read from.
VALUE_MEMBERS = (
    ("NVML_VALUE_TYPE_DOUBLE", "dVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
    ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),
)


@dataclass
class Gpu:
    """One GPU as seen by the current NVML session (handles die with the session).

    The optional fields belong to one part each (events, nvlink, gpm); they live here, not in
    those parts, so that a new session starts them afresh with the handle.
    """

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
    #: When the latest GPM sample was taken (the GPM sampler's clock), and the metrics of the
    #: window it closed, returned again until the next window closes.
    gpm_taken_at: float | None = None
    gpm_last: GpmSample | None = None
    #: For a MIG device: the physical GPU and its GPU instance id. For a physical GPU: its MIG
    #: devices, ``None`` until first looked for in this session ([] when MIG mode is off).
    parent: Gpu | None = None
    gpu_instance: int | None = None
    mig_devices: list[Gpu] | None = None


def decode_text(value: Any) -> str:
    # pynvml returns str on Python 3, but older releases and some fakes hand back bytes.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def unsupported_codes(lib: Any) -> set[int]:
    """NVML answers that mean "this GPU/driver/user will never get this field": not retried.

    NO_PERMISSION is here because a field restricted to root stays restricted for the process's
    life; FUNCTION_NOT_FOUND is an older driver without the entry point.
    """
    return {
        lib.NVML_ERROR_NOT_SUPPORTED,
        lib.NVML_ERROR_FUNCTION_NOT_FOUND,
        lib.NVML_ERROR_NO_PERMISSION,
    }


def library_mismatch(lib: Any) -> type[BaseException] | tuple[()]:
    """nvidia-ml-py's ``NVMLLibraryMismatchError`` (13.x), or ``()`` where it has none: its
    unversioned calls raise it, instead of an ``NVMLError``, when the driver lacks the newest
    versioned entry point they call."""
    found = getattr(lib, "NVMLLibraryMismatchError", None)
    return found if isinstance(found, type) and issubclass(found, BaseException) else ()


def union_value(lib: Any, value_type: int, value: Any) -> float:
    """Read an nvmlValue_t union according to its NVML_VALUE_TYPE_*."""
    # getattr with a default: nvidia-ml-py 12.535 has no NVML_VALUE_TYPE_UNSIGNED_SHORT, and a
    # type it does not know must be the HardwareError below, not an AttributeError.
    for const, member in VALUE_MEMBERS:
        if value_type == getattr(lib, const, None):
            return float(getattr(value, member))
    raise HardwareError(f"NVML returned an unknown value type {value_type}")


def quietly(lib: Any, what: str, call: Callable[[], object]) -> None:
    """Run a cleanup call, logging an NVMLError at debug instead of raising it."""
    # Teardown runs after failures, when NVML is expected to refuse; recovery must go on.
    try:
        call()
    except lib.NVMLError as err:
        log.debug("ignored NVML error while %s: %s", what, err)


class Memo:
    """What each GPU does not support and what was logged, across NVML sessions and threads.

    Keyed by GPU UUID, so a re-init after a GPU error does not forget capabilities. The PCIe
    thread uses it too, so it has its own lock, which is never held across an NVML call nor
    while taking the session lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unsupported: set[tuple[str, str]] = set()
        self._logged: set[str] = set()

    def log_once(
        self, logger: logging.Logger, key: str, level: int, msg: str, *args: object
    ) -> None:
        """Log ``msg`` on ``logger`` the first time ``key`` is seen; never again after."""
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        logger.log(level, msg, *args)

    def optional(
        self,
        lib: Any,
        gpu: Gpu,
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
        with self._lock:
            if key in self._unsupported:
                return None
        try:
            return call()
        except library_mismatch(lib) as err:
            # nvidia-ml-py 13 turns FUNCTION_NOT_FOUND from an unversioned call (whose newest
            # entry point this driver lacks) into NVMLLibraryMismatchError, not an NVMLError.
            why = f"the driver lacks the entry point nvidia-ml-py calls: {err}"
        except lib.NVMLError as err:
            if err.value in set(empty):
                return None
            if err.value not in unsupported_codes(lib):
                raise
            why = str(err)
        with self._lock:
            self._unsupported.add(key)
        self.log_once(
            log,
            f"unsupported:{key}",
            logging.INFO,
            "GPU %d (%s): %s not available (%s); leaving it absent",
            gpu.index,
            gpu.identity.uuid,
            feature,
            why,
        )
        return None

    def unsupported(self, uuid: str) -> list[str]:
        """The features remembered as not supported on this GPU, sorted (what doctor shows)."""
        with self._lock:
            return sorted(f for u, f in self._unsupported if u == uuid)


class NvmlSession:
    """The NVML library and its current session: initialised or not, and its GPUs.

    ``lib`` is the ``pynvml`` module or a stand-in; ``None`` imports ``pynvml`` on first use.
    ``open_gpu`` is called for each GPU as the session opens it (the XID event registration);
    ``close_gpu`` for each GPU at teardown, before NVML is shut down (freeing what
    ``open_gpu`` and the samplers set up on it).

    :attr:`lock` is held by every public call of the backend. One NVML session is shared by
    device and GPM sampling, and re-initialising it while another thread holds handles would
    hand that thread dead handles; hence one re-entrant lock around all of it.
    """

    def __init__(
        self,
        lib: Any | None,
        memo: Memo,
        *,
        open_gpu: Callable[[Any, Gpu], None],
        close_gpu: Callable[[Any, Gpu], None],
    ) -> None:
        self.lock = threading.RLock()
        self._lib: Any | None = lib
        self._memo = memo
        self._open_gpu = open_gpu
        self._close_gpu = close_gpu
        self._initialized = False
        self._needs_reinit = False
        self._failing = False
        self._gpus: list[Gpu] = []
        #: The library and GPUs of the session now up, replaced whole and never changed in
        #: place: set once :meth:`_init` has opened every GPU, cleared before teardown. What
        #: :meth:`snapshot` reads without the lock.
        self._published: tuple[Any, tuple[Gpu, ...]] | None = None

    def require_lib(self) -> Any:
        """The library, importing ``pynvml`` the first time (SourceUnavailable if absent)."""
        if self._lib is None:
            try:
                import pynvml
            except ImportError as err:
                raise self.unavailable("nvml_missing", f"cannot import pynvml: {err}") from err
            self._lib = pynvml
        return self._lib

    def ensure_ready(self) -> list[Gpu]:
        """This session's GPUs, (re-)initialising NVML first where needed. Holding :attr:`lock`."""
        if self._needs_reinit and self._initialized:
            self._teardown()
        if not self._initialized:
            self._init()
        return self._gpus

    def shutdown(self) -> None:
        """Free every GPU's resources and shut NVML down, if it is initialised."""
        if self._initialized:
            self._teardown()

    def snapshot(self) -> tuple[Any, list[Gpu]] | None:
        """The library and this session's GPUs, for the PCIe threads; ``None`` while no
        session is up. Never waits for :attr:`lock`.

        The sampler holds that lock through whole device and GPM passes (hundreds of ms on 8
        GPUs, longer when the process is CPU-throttled), and the narrow-counter thread must
        read every ~22 ms or lose wraps; so this reads the published pair, replaced whole by
        one reference assignment (atomic), instead of taking the lock. It cannot be torn: it
        is published after every GPU is open and withdrawn before teardown. A thread may still
        use handles a teardown has since killed, as it always could (the snapshot was always
        used after the lock was let go): that read fails with an NVMLError, which the threads
        skip for the round. NVML itself is thread-safe (NVML API reference, introduction).
        The lock stays what serialises sessions (init, re-init, teardown) and the backend's
        calls; the threads need none of that, only a consistent pair.
        """
        published = self._published
        if published is None:
            return None
        return published[0], list(published[1])

    def _init(self) -> None:
        lib = self.require_lib()
        try:
            lib.nvmlInit()
        except lib.NVMLError as err:
            raise self.failure(err, "initialising NVML") from err
        self._initialized = True
        self._needs_reinit = False
        try:
            count = int(lib.nvmlDeviceGetCount())
            gpus: list[Gpu] = []
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
                    self._memo.log_once(
                        log,
                        f"denied:{index}",
                        logging.WARNING,
                        "GPU %d: no permission, skipped",
                        index,
                    )
                    continue
                identity = GPUIdentity(
                    index=index,
                    uuid=decode_text(lib.nvmlDeviceGetUUID(handle)),
                    name=decode_text(lib.nvmlDeviceGetName(handle)),
                )
                gpu = Gpu(index=index, handle=handle, identity=identity)
                self._open_gpu(lib, gpu)
                gpus.append(gpu)
                self._gpus = gpus  # so a failure below still frees what was set up
        except lib.NVMLError as err:
            self._teardown()
            raise self.failure(err, "enumerating GPUs") from err
        if not gpus:
            self._teardown()
            if denied:
                raise self.unavailable("no_permission", f"no permission on any of {count} GPUs")
            raise self.unavailable("no_gpu", "NVML reports no GPU")
        self._gpus = gpus
        self._published = (lib, tuple(gpus))

    def _teardown(self) -> None:
        self._published = None  # first: the PCIe threads stop taking these handles up
        lib = self._lib
        if lib is not None:
            for gpu in self._gpus:
                self._close_gpu(lib, gpu)
            if self._initialized:
                quietly(lib, "shutting NVML down", lib.nvmlShutdown)
        self._gpus = []
        self._initialized = False
        self._needs_reinit = False

    # --- error mapping -----------------------------------------------------------------------

    def failure(self, err: Any, what: str) -> HardwareError:
        """Translate an NVMLError; every failure makes the next call start a fresh session."""
        lib = self.require_lib()
        self._needs_reinit = True
        reasons = {
            lib.NVML_ERROR_LIBRARY_NOT_FOUND: "nvml_missing",
            lib.NVML_ERROR_DRIVER_NOT_LOADED: "driver_not_loaded",
            lib.NVML_ERROR_NO_PERMISSION: "no_permission",
        }
        reason = reasons.get(err.value)
        if reason is not None:
            return self.unavailable(reason, f"{what}: {err}")
        if not self._failing:
            # Logged on the transition to failing only; the runner exports the ongoing state.
            log.warning(
                "NVML failed while %s: %s (code %s); will re-initialise", what, err, err.value
            )
        self._failing = True
        return HardwareError(f"NVML error while {what}: {err} (code {err.value})")

    def unavailable(self, reason: str, detail: str) -> SourceUnavailable:
        """A SourceUnavailable for ``reason``, logged once per reason."""
        self._memo.log_once(
            log,
            f"unavailable:{reason}",
            logging.WARNING,
            "NVML unavailable (%s): %s",
            reason,
            detail,
        )
        return SourceUnavailable(reason, detail)

    def note_success(self) -> None:
        """A call succeeded: log the recovery if the previous one had failed."""
        if self._failing:
            log.info("NVML answers again")
        self._failing = False
