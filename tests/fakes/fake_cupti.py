"""Hand-written fake of the slice of ``cupti-python`` (>= 13.3) that
``agent.core.hw.cupti_pm`` uses.

It mirrors the real library's shape and the behaviour its docstrings promise:

- ``lib.pm_sampling.Collector(device_index)`` with ``enable / configure / start / decode / stop /
  disable``; ``configure`` raises ValueError for a metric the chip's PM sampling does not offer
  or an unsupported trigger mode, ``start`` / ``stop`` raise RuntimeError out of order, and
  ``decode(max_samples)`` hands back at most ``max_samples`` completed samples, leaving the rest
  in the "hardware buffer" for the next decode.
- ``lib.pm_sampling.TriggerMode`` with the values of ``CUpti_PmSampling_TriggerMode``.
- ``lib.cupti.cuptiError`` (carries ``.status``) and ``lib.cupti.Result`` with the values of
  ``cupti_result.h``.

A device is described by data: which metrics and trigger modes it accepts, the samples its
hardware produces (one list per decode call) and the errors to raise per call.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class Result(enum.IntEnum):
    """The CUptiResult codes the sampler reads (values from cupti_result.h)."""

    SUCCESS = 0
    ERROR_INVALID_PARAMETER = 1
    ERROR_INVALID_DEVICE = 2
    ERROR_INVALID_OPERATION = 7
    ERROR_OUT_OF_MEMORY = 8
    ERROR_HARDWARE = 9
    ERROR_NOT_INITIALIZED = 15
    ERROR_INVALID_METRIC_NAME = 17
    ERROR_DISABLED = 23
    ERROR_HARDWARE_BUSY = 26
    ERROR_NOT_SUPPORTED = 27
    ERROR_VIRTUALIZED_DEVICE_NOT_SUPPORTED = 33
    ERROR_INSUFFICIENT_PRIVILEGES = 35
    ERROR_OLD_PROFILER_API_INITIALIZED = 36
    ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39
    ERROR_VIRTUALIZED_DEVICE_INSUFFICIENT_PRIVILEGES = 40
    ERROR_MIG_DEVICE_NOT_SUPPORTED = 43
    ERROR_UNKNOWN = 999


class cuptiError(Exception):  # spelled like the real class
    """Like ``cupti.cupti.cuptiError``: ``str()`` is ``"ERROR_NAME (code)"``."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"{Result(status).name} ({int(status)})")


class NotSupportedError(RuntimeError):
    """Like ``cupti._internal.utils.NotSupportedError`` (no CUDA driver on the host)."""


class TriggerMode(enum.IntEnum):
    GPU_SYSCLK_INTERVAL = 0
    GPU_TIME_INTERVAL = 1


def error(name: str) -> cuptiError:
    """A cuptiError for a Result name, e.g. ``error("ERROR_HARDWARE_BUSY")``."""
    return cuptiError(Result[name])


@dataclass
class FakeDevice:
    """One GPU as the fake library sees it.

    ``decodes`` holds, per decode call while sampling runs, the samples the hardware completed
    since the previous one (consumed as they are decoded); each sample maps a metric name to
    that interval's value. ``errors`` maps a Collector method name to outcomes consumed one
    per call (an exception to raise, or ``None`` to go ahead); when a method's list runs out
    it succeeds.
    """

    supported_metrics: frozenset[str] = frozenset(
        {"sm__inst_executed_realtime.sum", "sm__inst_executed.sum", "dram__bytes_read.sum"}
    )
    supports_time_interval: bool = True
    decodes: list[list[dict[str, float]]] = field(default_factory=list)
    errors: dict[str, list[BaseException | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class Sample:
    start_timestamp: int
    end_timestamp: int
    metric_values: list[float]


class CounterData:
    """Like ``cupti.pm_sampling.CounterData``: ``metrics`` plus iteration over samples."""

    def __init__(self, metrics: list[str], samples: list[Sample]) -> None:
        self.metrics = metrics
        self._samples = samples
        self.num_completed_samples = len(samples)

    def __len__(self) -> int:
        return len(self._samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self._samples)


class FakeCupti:
    """Stands in for the ``cupti`` package: ``.pm_sampling`` and ``.cupti`` namespaces."""

    def __init__(self, devices: dict[int, FakeDevice] | None = None) -> None:
        self.devices: dict[int, FakeDevice] = devices if devices is not None else {}
        self.collectors: list[Collector] = []
        self.calls: list[tuple[int, str]] = []
        fake = self

        class BoundCollector(Collector):
            def __init__(self, device_index: int = 0) -> None:
                super().__init__(fake, device_index)

        self.pm_sampling = SimpleNamespace(
            Collector=BoundCollector, TriggerMode=TriggerMode, CounterData=CounterData
        )
        self.cupti = SimpleNamespace(cuptiError=cuptiError, Result=Result)

    def count(self, index: int, method: str) -> int:
        """How often ``method`` was called on device ``index``'s collectors."""
        return sum(1 for i, m in self.calls if (i, m) == (index, method))


class Collector:
    """Per-device collector with the real one's state rules."""

    def __init__(self, lib: FakeCupti, device_index: int = 0) -> None:
        self._lib = lib
        self.device_index = device_index
        self.enabled = False
        self.started = False
        self.metrics: list[str] | None = None
        self.config: dict[str, Any] = {}
        self._pending: list[dict[str, float]] = []
        self._time = 0
        lib.collectors.append(self)

    def _call(self, method: str) -> FakeDevice:
        self._lib.calls.append((self.device_index, method))
        device = self._lib.devices.get(self.device_index)
        outcomes = device.errors.get(method) if device is not None else None
        if outcomes:
            outcome = outcomes.pop(0)
            if outcome is not None:
                raise outcome
        if device is None:
            # What Collector.enable() raises when cuptiDeviceGetChipName rejects the index.
            raise ValueError(f"Invalid device_index: {self.device_index}")
        return device

    def enable(self) -> None:
        self._call("enable")
        if self.enabled:
            raise RuntimeError("PM sampling is already enabled on this device.")
        self.enabled = True

    def configure(
        self,
        *,
        metrics: list[str],
        hardware_buffer_size: int = 512 * 1024 * 1024,
        sampling_interval: int = 10000,
        trigger_mode: TriggerMode = TriggerMode.GPU_TIME_INTERVAL,
    ) -> None:
        device = self._call("configure")
        if not self.enabled:
            raise RuntimeError("Collector is not enabled. Call enable() first.")
        if hardware_buffer_size <= 0 or sampling_interval <= 0:
            raise ValueError("hardware_buffer_size and sampling_interval must be > 0")
        unknown = [m for m in metrics if m not in device.supported_metrics]
        if unknown:
            raise ValueError(f"Invalid metrics {unknown}")
        if trigger_mode == TriggerMode.GPU_TIME_INTERVAL and not device.supports_time_interval:
            raise ValueError("Requested PM sampling configuration is not supported.")
        self.metrics = list(metrics)
        self.config = {
            "hardware_buffer_size": hardware_buffer_size,
            "sampling_interval": sampling_interval,
            "trigger_mode": trigger_mode,
        }

    def start(self) -> None:
        self._call("start")
        if not self.enabled:
            raise RuntimeError("Collector is not enabled. Call enable() first.")
        if self.metrics is None:
            raise RuntimeError("Collector is not configured. Call configure() first.")
        if self.started:
            raise RuntimeError("PM Sampling collection has already started")
        self.started = True

    def stop(self) -> None:
        self._call("stop")
        if not self.enabled:
            raise RuntimeError("Collector is not enabled. Call enable() first.")
        if self.metrics is None:
            raise RuntimeError("Collector is not configured. Call configure() first.")
        if not self.started:
            raise RuntimeError("PM Sampling collection has already stopped")
        self.started = False

    def decode(self, max_samples: int = 10000) -> CounterData:
        device = self._call("decode")
        if not self.enabled:
            raise RuntimeError("Collector is not enabled. Call enable() first.")
        if max_samples <= 0:
            raise ValueError("max_samples must be > 0")
        assert self.metrics is not None, "decode() before configure()"
        if self.started and device.decodes:
            # The hardware produced this batch since the last decode; kept on the device so a
            # restarted collector does not see it again.
            self._pending.extend(device.decodes.pop(0))
        taken, self._pending = self._pending[:max_samples], self._pending[max_samples:]
        samples = []
        for record in taken:
            self._time += 1
            values = [record.get(m, 0.0) for m in self.metrics]
            samples.append(Sample(self._time - 1, self._time, values))
        return CounterData(list(self.metrics), samples)

    def disable(self) -> None:
        self._call("disable")
        self.enabled = False
        self.started = False
