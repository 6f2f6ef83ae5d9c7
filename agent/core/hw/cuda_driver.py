"""The CUDA driver calls the CUPTI PM sampling source needs: ``cuInit`` and, only where CUPTI
will not enable PM sampling without one, a device's primary context.

CUPTI talks to the GPU through the CUDA driver, and the driver answers nothing (CUPTI then
reports ``ERROR_NOT_INITIALIZED``) until the process has called ``cuInit(0)``. The agent is a
sidecar that never runs CUDA work itself, so it calls ``cuInit`` before the first
``Collector.enable()``. That costs no device memory: it loads the driver and enumerates devices.

A primary context does cost device memory: typically a few hundred MiB per GPU on recent GPUs
(the driver's per-context reservations: local memory, printf/malloc heaps, the code of its
modules), taken from the service the agent watches. The exact cost on an H200 is to be measured
on the hardware check. The agent therefore takes one only when ``enable()`` still refuses with
"not initialised" after ``cuInit``, keeps it while that GPU samples and releases it at close.

CUPTI numbers devices as CUDA does (the ordinal of ``cuDeviceGet``), and that is NVML's index
only by luck: NVML counts every GPU in PCI order, while CUDA skips GPUs it cannot use, orders
them fastest-first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, renumbers them under
``CUDA_VISIBLE_DEVICES`` and, in MIG mode, enumerates MIG compute instances instead.
:meth:`CudaDriver.ordinals` therefore maps each CUDA device to NVML's name for it, its UUID
(``cuDeviceGetUuid``: 16 bytes, written as NVML writes them, ``GPU-`` and 8-4-4-4-12 lower-case
hex digits). In MIG mode the driver answers the MIG instance's UUID, which matches no GPU's.

The calls go through ``cuda.bindings.driver`` (cuda-bindings, a dependency of cupti-python),
imported on first use; tests pass a hand-written fake module of the same shape. Its functions
return ``(CUresult, value...)`` tuples and raise cuda-pathfinder's ``DynamicLibNotFoundError``
when ``libcuda.so.1`` is absent. Failures become the project's own errors here:
:class:`SourceUnavailable` with a bounded reason (``cuda_missing``, ``no_gpu``) where the host
cannot run CUDA, :class:`HardwareError` for anything that may pass.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from mrc_agent.agent.core.hw.base import HardwareError, SourceUnavailable

log = logging.getLogger(__name__)

#: Why libcuda.so.1 is usually absent where NVML works: the NVIDIA container runtime mounts
#: only the libraries NVIDIA_DRIVER_CAPABILITIES names, and ``utility`` alone means NVML only.
LIBCUDA_MISSING = (
    "libcuda.so.1 not found: the container needs NVIDIA_DRIVER_CAPABILITIES to include "
    "compute (with only 'utility' it gets NVML but no CUDA driver)"
)

#: CUresult names (cuda.h) that mean this process cannot use CUDA, and the reason each becomes.
#: Everything else (CUDA_ERROR_SYSTEM_NOT_READY while the fabric manager starts, out of memory,
#: CUDA_ERROR_UNKNOWN) may pass and is a HardwareError, retried with a backoff by the caller.
_REASON_BY_CURESULT: dict[str, str] = {
    "CUDA_ERROR_NO_DEVICE": "no_gpu",  # none visible: CUDA_VISIBLE_DEVICES, device plugin
    "CUDA_ERROR_INVALID_DEVICE": "no_gpu",  # cuDeviceGet: no such ordinal
    "CUDA_ERROR_STUB_LIBRARY": "cuda_missing",  # the toolkit's stub libcuda, not the driver
    "CUDA_ERROR_INSUFFICIENT_DRIVER": "cuda_missing",  # driver older than the runtime needs
    "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER": "cuda_missing",
    "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH": "cuda_missing",  # user-mode and kernel driver differ
    "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE": "cuda_missing",
}

#: cuda-pathfinder's exception classes (RuntimeError subclasses) for a library it cannot load.
_MISSING_LIBRARY_ERRORS = frozenset({"DynamicLibNotFoundError", "DynamicLibNotAvailableError"})


class CudaDriver:
    """``cuInit`` and primary contexts through ``cuda.bindings.driver``.

    ``module`` is that module (imported on first use when ``None``); tests pass a fake.
    :meth:`init` is idempotent, as ``cuInit`` itself is. Not thread-safe: the sampler calls it
    under its own lock.
    """

    def __init__(self, module: Any | None = None) -> None:
        self._module = module
        self._initialised = False
        #: CUDA device index -> the CUdevice whose primary context this object retained.
        self._retained: dict[int, Any] = {}
        #: NVML-style UUID -> CUDA ordinal, read once: CUDA enumerates devices at cuInit.
        self._ordinals: dict[str, int] | None = None

    @property
    def retained(self) -> tuple[int, ...]:
        """Device indices whose primary context is held, in the order they were retained."""
        return tuple(self._retained)

    def init(self) -> None:
        """Initialise the CUDA driver for this process (``cuInit(0)``)."""
        if self._initialised:
            return
        driver = self._driver()
        self._check(driver, "cuInit", self._call(driver.cuInit, 0))
        self._initialised = True

    def ordinals(self) -> dict[str, int]:
        """The CUDA ordinal of every device this process's CUDA enumerates, keyed by its UUID
        in NVML's form (:func:`format_uuid`). Read once, after ``cuInit``.

        ``cuDeviceGetUuid_v2`` where the bindings have it (cuda-bindings 12.x; in 13.x plain
        ``cuDeviceGetUuid`` is that call): in MIG mode it answers the MIG instance's UUID, so
        a MIG instance is never taken for its parent GPU.
        """
        if self._ordinals is None:
            driver = self._driver()
            self.init()
            count = self._check(driver, "cuDeviceGetCount", self._call(driver.cuDeviceGetCount))
            get_uuid = getattr(driver, "cuDeviceGetUuid_v2", None) or driver.cuDeviceGetUuid
            found: dict[str, int] = {}
            for ordinal in range(int(count)):
                device = self._check(driver, "cuDeviceGet", self._call(driver.cuDeviceGet, ordinal))
                uuid = self._check(driver, "cuDeviceGetUuid", self._call(get_uuid, device))
                found.setdefault(format_uuid(_uuid_bytes(uuid)), ordinal)
            self._ordinals = found
            log.debug("CUDA devices by UUID: %s", found)
        return dict(self._ordinals)

    def retain_primary_context(self, index: int) -> None:
        """Retain device ``index``'s primary context and make it current on this thread.

        Made current as NVIDIA's cupti-python samples do (``ensure_cuda_initialized``);
        whether CUPTI needs it current or only existing is to be checked on the hardware.
        Costs device memory (see the module docstring) until :meth:`release_primary_context`.
        """
        if index in self._retained:
            return
        driver = self._driver()
        self.init()
        device = self._check(driver, "cuDeviceGet", self._call(driver.cuDeviceGet, index))
        ctx = self._check(
            driver, "cuDevicePrimaryCtxRetain", self._call(driver.cuDevicePrimaryCtxRetain, device)
        )
        self._retained[index] = device
        try:
            self._check(driver, "cuCtxSetCurrent", self._call(driver.cuCtxSetCurrent, ctx))
        except HardwareError:
            self.release_primary_context(index)
            raise
        log.info(
            "retained the CUDA primary context of GPU %d for CUPTI (it holds device memory "
            "until the agent stops)", index
        )

    def release_primary_context(self, index: int) -> None:
        """Release a context :meth:`retain_primary_context` took. Never raises: a failed
        release is logged, as it only happens while giving the GPU up."""
        device = self._retained.pop(index, None)
        if device is None:
            return
        try:
            self._check(
                self._driver(), "cuDevicePrimaryCtxRelease",
                self._call(self._driver().cuDevicePrimaryCtxRelease, device),
            )
        except HardwareError as exc:
            log.warning("releasing the CUDA primary context of GPU %d failed: %s", index, exc)

    def close(self) -> None:
        """Release every primary context still held. Safe to call twice."""
        for index in list(self._retained):
            self.release_primary_context(index)

    # -- helpers --------------------------------------------------------------------------------

    def _driver(self) -> Any:
        if self._module is None:
            try:
                # Imported here, never at module import: only the opt-in profiling source needs
                # it, and it loads nothing until a function is called.
                self._module = importlib.import_module("cuda.bindings.driver")
            except ImportError as exc:
                raise SourceUnavailable(
                    "cuda_missing",
                    f"cannot import cuda.bindings.driver ({exc}); it comes with cupti-python "
                    "(install mrc-agent[profiling])",
                ) from None
        return self._module

    @staticmethod
    def _call(function: Any, *args: Any) -> Any:
        try:
            return function(*args)
        except (RuntimeError, OSError) as exc:
            if isinstance(exc, OSError) or type(exc).__name__ in _MISSING_LIBRARY_ERRORS:
                raise SourceUnavailable("cuda_missing", f"{LIBCUDA_MISSING} ({exc})") from None
            raise HardwareError(f"{function.__name__}: {exc}") from exc

    @staticmethod
    def _check(driver: Any, call: str, answer: Any) -> Any:
        """The value of a ``(CUresult, value...)`` answer, or the error the result means."""
        result, *values = answer  # every cuda.bindings.driver function answers a tuple
        if int(result) == 0:  # CUDA_SUCCESS
            return values[0] if values else None
        name = _result_name(driver, result)
        detail = f"{call} failed: {name} ({int(result)})"
        reason = _REASON_BY_CURESULT.get(name)
        if reason is not None:
            raise SourceUnavailable(reason, detail)
        raise HardwareError(detail)


def _result_name(driver: Any, result: Any) -> str:
    """The CUresult name of ``result`` (an enum member or a plain code), else its text."""
    try:
        return str(driver.CUresult(int(result)).name)
    except (AttributeError, TypeError, ValueError):
        return str(result)


def format_uuid(raw: bytes) -> str:
    """16 UUID bytes as NVML writes a GPU's UUID: ``GPU-`` and 8-4-4-4-12 lower-case hex digits,
    byte by byte in order (as ``nvidia-smi -L`` shows them)."""
    if len(raw) != 16:
        raise HardwareError(f"cuDeviceGetUuid answered {len(raw)} bytes, not 16")
    text = raw.hex()
    return f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def _uuid_bytes(uuid: Any) -> bytes:
    """The 16 bytes of a ``CUuuid`` (its ``bytes`` attribute). A ``str`` (a ``char[16]`` some
    bindings hand over as text) is taken one character per byte."""
    raw = getattr(uuid, "bytes", uuid)
    if isinstance(raw, str):
        return raw.encode("latin-1")
    return bytes(raw)
