"""The simulated ``cuda.bindings.driver``: the CUDA driver calls cupti-python's users make
before PM sampling (``cuInit``, device enumeration and UUIDs, primary contexts), answering
``(CUresult, value...)`` tuples as cuda-bindings 13.x does, for :class:`~.cupti.FakeCupti`.

``library_missing`` makes every call raise cuda-pathfinder's ``DynamicLibNotFoundError`` (no
libcuda.so.1); ``errors`` injects a result or an exception per call; ``init_results`` what
``cuInit`` answers. The devices are the library's ``devices``, keyed by CUDA ordinal;
``cuDeviceGetUuid`` answers a ``CUuuid`` whose ``bytes`` are the 16 raw bytes of the device's
``uuid`` (by default :func:`fake_uuid` of its ordinal).
"""

from __future__ import annotations

import enum
from typing import Any, Protocol


class _Library(Protocol):
    """What the driver reads of its ``cupti`` fake: the devices by CUDA ordinal."""

    devices: dict[int, Any]


class DynamicLibNotFoundError(RuntimeError):
    """Like ``cuda.pathfinder``'s error when a cuda-bindings call finds no libcuda.so.1."""


class CUresult(enum.IntEnum):
    """The CUresult codes the fake driver answers (values from cuda.h)."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_STUB_LIBRARY = 34
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_SYSTEM_NOT_READY = 802
    CUDA_ERROR_UNKNOWN = 999


def fake_uuid(ordinal: int) -> str:
    """The UUID a :class:`FakeDevice` without one reports for CUDA ordinal ``ordinal``."""
    return f"GPU-{ordinal:08x}-0000-4000-8000-{ordinal:012x}"


class CUuuid:
    """Like ``cuda.bindings.driver.CUuuid``: the 16 raw bytes in ``bytes``."""

    def __init__(self, raw: bytes) -> None:
        self.bytes = raw


#: The enum under a name the fake driver's annotations can use beside its ``CUresult`` attribute.
_Result = CUresult


class FakeCudaDriver:
    """Stands in for ``cuda.bindings.driver``: answers ``(CUresult, value...)`` tuples."""

    CUresult = _Result

    def __init__(self, lib: _Library) -> None:
        self._lib = lib
        self.library_missing = False
        #: Results cuInit answers, consumed one per call; CUDA_SUCCESS once it runs out.
        self.init_results: list[_Result] = []
        self.initialised = False
        #: Device index -> primary-context references held.
        self.retained: dict[int, int] = {}
        self.current: int | None = None
        self.calls: list[str] = []
        #: Per function name, outcomes consumed one per call before anything else: a CUresult
        #: to answer (with ``None`` for any value) or an exception to raise.
        self.errors: dict[str, list[_Result | BaseException]] = {}

    def _enter(self, name: str) -> _Result | None:
        """Record the call; the injected result it answers instead, if any."""
        self.calls.append(name)
        if self.library_missing:
            raise DynamicLibNotFoundError(
                '"cuda" is an NVIDIA driver library and can only be found via system search. '
                "Ensure the NVIDIA display driver is installed."
            )
        outcomes = self.errors.get(name)
        outcome = outcomes.pop(0) if outcomes else None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def cuInit(self, flags: int) -> tuple[_Result]:
        injected = self._enter("cuInit")
        if injected is not None:
            return (injected,)
        if flags != 0:
            return (_Result.CUDA_ERROR_INVALID_CONTEXT,)
        result = self.init_results.pop(0) if self.init_results else _Result.CUDA_SUCCESS
        if result == _Result.CUDA_SUCCESS:
            self.initialised = True
        return (result,)

    def cuDeviceGetCount(self) -> tuple[_Result, int]:
        injected = self._enter("cuDeviceGetCount")
        if injected is not None:
            return (injected, 0)
        if not self.initialised:
            return (_Result.CUDA_ERROR_NOT_INITIALIZED, 0)
        # Ordinals are 0..count-1, as CUDA numbers them.
        return (_Result.CUDA_SUCCESS, max(self._lib.devices, default=-1) + 1)

    def cuDeviceGetUuid(self, dev: int) -> tuple[_Result, CUuuid | None]:
        injected = self._enter("cuDeviceGetUuid")
        if injected is not None:
            return (injected, None)
        if not self.initialised:
            return (_Result.CUDA_ERROR_NOT_INITIALIZED, None)
        device = self._lib.devices.get(dev)
        if device is None:
            return (_Result.CUDA_ERROR_INVALID_DEVICE, None)
        text = device.uuid or fake_uuid(dev)
        return (_Result.CUDA_SUCCESS, CUuuid(bytes.fromhex(text.split("-", 1)[1].replace("-", ""))))

    def cuDeviceGet(self, ordinal: int) -> tuple[_Result, int | None]:
        injected = self._enter("cuDeviceGet")
        if injected is not None:
            return (injected, None)
        if not self.initialised:
            return (_Result.CUDA_ERROR_NOT_INITIALIZED, None)
        if ordinal not in self._lib.devices:
            return (_Result.CUDA_ERROR_INVALID_DEVICE, None)
        return (_Result.CUDA_SUCCESS, ordinal)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[_Result, str | None]:
        injected = self._enter("cuDevicePrimaryCtxRetain")
        if injected is not None:
            return (injected, None)
        if not self.initialised:
            return (_Result.CUDA_ERROR_NOT_INITIALIZED, None)
        self.retained[dev] = self.retained.get(dev, 0) + 1
        return (_Result.CUDA_SUCCESS, f"ctx{dev}")

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple[_Result]:
        injected = self._enter("cuDevicePrimaryCtxRelease")
        if injected is not None:
            return (injected,)
        if not self.retained.get(dev):
            return (_Result.CUDA_ERROR_INVALID_CONTEXT,)
        self.retained[dev] -= 1
        if not self.retained[dev]:
            del self.retained[dev]
        return (_Result.CUDA_SUCCESS,)

    def cuCtxSetCurrent(self, ctx: str | None) -> tuple[_Result]:
        injected = self._enter("cuCtxSetCurrent")
        if injected is not None:
            return (injected,)
        self.current = int(ctx[3:]) if ctx else None
        return (_Result.CUDA_SUCCESS,)
