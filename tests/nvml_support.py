"""What the NVML adapter's tests share: fixed clocks, a backend on them over the fake pynvml,
GPM values in NVML's units, and the log lines of the adapter's logger."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from mrc_agent.agent.core.hw.nvml import NvmlBackend
from mrc_agent.agent.tools.simgpu import nvml as simulated_nvml
from mrc_agent.agent.tools.simgpu.nvml import FakeHandle, FakeNvml
from tests.support import Clock

WALL_NOW = 1_700_000_000.0  # the fake wall clock, seconds since the epoch
MONO_NOW = 5_000.0  # the fake monotonic clock


class Ticker:
    """A clock that moves ``step`` seconds on every reading (one GPM window per call)."""

    def __init__(self, step: float = 1.0, now: float = MONO_NOW) -> None:
        self.step, self.now = step, now

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def backend(fake: FakeNvml, **kwargs: Any) -> NvmlBackend:
    """A backend on fixed clocks and without the PCIe thread: tests call ``_pcie.run_round()``.

    Its GPM clock moves one window per call, so every ``sample_gpm`` takes a new sample.
    """
    kwargs.setdefault("clock", lambda: MONO_NOW)
    kwargs.setdefault("pcie_thread", False)
    kwargs.setdefault("gpm_clock", Ticker())
    return NvmlBackend(lib=fake, wall_clock=lambda: WALL_NOW, **kwargs)


class FakeClock(Clock):
    """A monotonic clock the test moves by hand, starting at :data:`MONO_NOW`."""

    def __init__(self, now: float = MONO_NOW) -> None:
        super().__init__(now)


def gpm_values(**overrides: float) -> dict[int, float]:
    values = {
        pynvml.NVML_GPM_METRIC_SM_UTIL: 80.0,
        pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 40.0,
        pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 25.0,
        pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 50.0,
        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 100.0,
        pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 200.0,
        pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: 3.0,
        pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: 4.0,
    }
    for name, value in overrides.items():
        values[getattr(pynvml, f"NVML_GPM_METRIC_{name}")] = value
    return values


NVML_LOGGER = "mrc_agent.agent.core.hw.nvml"
UUID0, UUID1 = "GPU-00000000-fake-uuid", "GPU-00000001-fake-uuid"


def messages(caplog: pytest.LogCaptureFixture, part: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if part in r.getMessage()]


def counted(tx: float, rx: float,
            value_type: str = "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG") -> dict[str, Any]:
    """A fake GPU's ``pcie_count``: raw TX and RX byte counts and the value type they come
    back as (the fake wraps an unsigned int at 2^32)."""
    return {"tx_bytes": int(tx), "rx_bytes": int(rx), "value_type": value_type}


def load_fake_for(module: Any) -> Any:
    """The simulated ``pynvml`` loaded again with ``pynvml`` bound to ``module`` (e.g. an older
    nvidia-ml-py): its constants, structures, error classes and set of functions are then that
    version's. Returns the new module object (use its ``FakeNvml`` and ``gpu``)."""
    name = f"{simulated_nvml.__name__}_for_{id(module)}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, simulated_nvml.__file__)
    assert spec is not None and spec.loader is not None
    fake = importlib.util.module_from_spec(spec)
    sys.modules[name] = fake  # its dataclasses look their module up while it loads
    spec.loader.exec_module(fake)
    fake.__dict__["pynvml"] = module  # the global every function of the copy reads
    return fake


@dataclass
class FakeEventSet:
    gpus: list[int] = field(default_factory=list)
    event_types: int = 0
    freed: bool = False


class EventNvml(FakeNvml):
    """The simulated ``pynvml`` with NVML's event sets, for the tests of the adapter's XID
    events: each GPU dict's ``xid_events`` are delivered, oldest first, through the event set
    its handle was registered with. ``event_sets`` lists every set created; ``wait_timeouts``
    every ``nvmlEventSetWait`` timeout. (The shipped fake delivers no events.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.event_sets: list[FakeEventSet] = []
        self.wait_timeouts: list[int] = []

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._enter("nvmlEventSetCreate")
        event_set = FakeEventSet()
        self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(
        self, handle: FakeHandle, eventTypes: int, eventSet: FakeEventSet
    ) -> None:
        self._gpu("nvmlDeviceRegisterEvents", handle)
        if eventSet.freed:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        eventSet.gpus.append(handle.index)
        eventSet.event_types |= eventTypes

    def nvmlEventSetWait(self, eventSet: FakeEventSet, timeoutms: int) -> Any:
        self._enter("nvmlEventSetWait")
        self.wait_timeouts.append(timeoutms)
        if eventSet.freed:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if eventSet.event_types & pynvml.nvmlEventTypeXidCriticalError:
            for index in eventSet.gpus:
                queue = self.gpus[index]["xid_events"]
                if queue:
                    data = pynvml.c_nvmlEventData_t()
                    data.eventType = pynvml.nvmlEventTypeXidCriticalError
                    data.eventData = queue.pop(0)
                    return data
        raise self._error(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, eventSet: FakeEventSet) -> None:
        self._count("nvmlEventSetFree")
        eventSet.freed = True
