"""The simulated ``cupti``: a hand-written, data-driven fake of the slice of ``cupti-python``
(>= 13.3) that ``agent.core.hw.cupti_pm`` and the self-check use, with the
``cuda.bindings.driver`` calls they make first (:mod:`.cuda`). The tests and
``mrc-agent selfcheck --dry`` both use it.

It mirrors the real libraries' shape and the behaviour their sources show (cupti-python 13.4
``pm_sampling.py`` / ``profiler_host.py``, cuda-bindings 13.x):

- ``lib.pm_sampling.Collector(device_index)`` with ``enable / configure / start / decode / stop /
  disable``. ``enable()`` first calls ``profiler_initialize`` (process-wide, counted here in
  ``lib.profiler_refs``), then resolves the chip name, which answers ``ERROR_NOT_INITIALIZED``
  until the process called ``cuInit``, then enables PM sampling, which on a device built with
  ``needs_primary_context`` answers ``ERROR_NOT_INITIALIZED`` until its primary context is
  retained. On any failure except RuntimeError it rolls back with ``profiler_deinitialize``,
  exactly as the real ``enable()`` does; ``disable()`` of an enabled collector also calls
  ``profiler_deinitialize``. Whether real CUPTI counts these calls is unknown; the fake counts
  them and, once the count is back to zero, every still-enabled collector answers
  ``ERROR_NOT_INITIALIZED`` (the profiler was torn down under it).
- ``configure`` raises ValueError for a metric the chip's PM sampling does not offer, for
  metrics outside the named single-pass set, for an unknown set name and for an unsupported
  trigger mode; ``start`` / ``stop`` raise RuntimeError out of order, and
  ``decode(max_samples)`` hands back at most ``max_samples`` completed samples, leaving the
  rest in the "hardware buffer" for the next decode. A queued record's ``START``/``END`` keys
  (nanoseconds) become the sample's stamps; without them the stamps count 0, 1, 2, ...
- ``lib.profiler_host.get_single_pass_sets(chip)`` / ``get_metrics_in_single_pass_set(chip,
  set)`` with the real ValueErrors for an unsupported chip or set (absent with
  ``set_api=False``, as in cupti-python before 13.4).
- ``lib.pm_sampling.TriggerMode``, ``lib.cupti.cuptiError`` (carries ``.status``) and
  ``lib.cupti.Result`` with the values of ``CUpti_PmSampling_TriggerMode`` / ``cupti_result.h``.
- ``lib.driver`` (:class:`~.cuda.FakeCudaDriver`): ``cuInit / cuDeviceGetCount / cuDeviceGet /
  cuDeviceGetUuid / cuDevicePrimaryCtxRetain / cuDevicePrimaryCtxRelease / cuCtxSetCurrent``.
  The keys of ``FakeCupti.devices`` are CUDA ordinals (what ``Collector(device_index)`` and
  ``cuDeviceGet`` take); ``cuDeviceGetUuid`` answers a ``CUuuid`` whose ``bytes`` are the 16
  raw bytes of the device's ``uuid`` (by default :func:`fake_uuid` of its ordinal), so a test
  gives NVML's GPUs other indices than CUDA's to model ``CUDA_VISIBLE_DEVICES`` or a GPU CUDA
  skips.
- ``FakeCupti(counted=False)`` models the other reading of CUPTI's process-wide profiler: any
  ``profiler_deinitialize`` tears it down for every collector, however many enabled it.

A device is described by data: which metrics, sets and trigger modes it accepts, the samples
its hardware produces (one list per decode call) and the errors to raise per call. An injected
error is what the call answers before anything else the fake models (for ``enable`` right
after ``profiler_initialize``, so the real rollback follows it). ``on_call`` runs next, with
the collector and the method's name: a scenario may raise there, or queue the samples its own
clock has completed (the dry run integrates its model so).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from mrc_agent.agent.tools.simgpu import chips
from mrc_agent.agent.tools.simgpu.chips import base_name, unit_of_name
from mrc_agent.agent.tools.simgpu.cuda import CUresult as CUresult
from mrc_agent.agent.tools.simgpu.cuda import CUuuid as CUuuid
from mrc_agent.agent.tools.simgpu.cuda import DynamicLibNotFoundError as DynamicLibNotFoundError
from mrc_agent.agent.tools.simgpu.cuda import FakeCudaDriver
from mrc_agent.agent.tools.simgpu.cuda import fake_uuid as fake_uuid


class Result(enum.IntEnum):
    """The CUptiResult codes the sampler reads (values from cupti_result.h)."""

    SUCCESS = 0
    ERROR_INVALID_PARAMETER = 1
    ERROR_INVALID_DEVICE = 2
    ERROR_INVALID_OPERATION = 7
    ERROR_OUT_OF_MEMORY = 8
    ERROR_HARDWARE = 9
    ERROR_NOT_COMPATIBLE = 14
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
    ERROR_INVALID_CHIP_NAME = 46
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

    ``supported_metrics`` is what ``configure`` accepts without a set name;
    ``single_pass_sets`` maps each single-pass set to the metric names CUPTI lists for it
    (full or base names), which ``configure(single_pass_metric_set_name=...)`` accepts by base
    name. ``decodes`` holds, per decode call while sampling runs, the samples the hardware
    completed since the previous one (consumed as they are decoded); each sample maps a metric
    name to that interval's value. ``errors`` maps a Collector method name to outcomes consumed
    one per call (an exception to raise, or ``None`` to go ahead); when a method's list runs
    out it succeeds.
    """

    supported_metrics: frozenset[str] = frozenset(
        {"sm__inst_executed_realtime.sum", "sm__inst_executed.sum", "dram__bytes_read.sum"}
    )
    chip_name: str = "GH100"
    #: The UUID CUDA reports for the device, in NVML's form; "" for :func:`fake_uuid`.
    uuid: str = ""
    single_pass_sets: dict[str, list[str]] = field(default_factory=dict)
    needs_primary_context: bool = False
    supports_time_interval: bool = True
    decodes: list[list[dict[str, float]]] = field(default_factory=list)
    errors: dict[str, list[BaseException | None]] = field(default_factory=dict)
    #: ``get_metric_properties(name).dim_unit`` by name less rollup; others: unit_of_name.
    metric_units: dict[str, str] = field(default_factory=dict)


def shipped_device(sets: dict[str, Any] | None = None, **overrides: Any) -> FakeDevice:
    """A device offering the wheel's set (:func:`.chips.load_sets`): its metrics by base name
    with the set, or with ``.sum`` without one; its throughput user metrics likewise, with
    ``.avg.pct_of_peak_sustained_elapsed`` without the set."""
    data = sets or chips.load_sets()
    throughputs = [name for name in data["user_metrics"] if "throughput" in name]
    fields: dict[str, Any] = {
        "chip_name": data["chip"],
        "supported_metrics": frozenset([m + chips.COUNTER_ROLLUP for m in data["metrics"]]
                                       + [m + chips.THROUGHPUT_ROLLUP for m in throughputs]),
        "single_pass_sets": {data["set"]: list(data["metrics"])},
    }
    fields.update(overrides)
    return FakeDevice(**fields)


#: Keys of a queued record that carry the sample's stamps rather than a metric's value.
START, END = "__start_ns", "__end_ns"


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
    """Stands in for the ``cupti`` package: ``.pm_sampling``, ``.profiler_host``, ``.cupti``,
    plus ``.driver`` for the CUDA driver that cupti-python's cuda-bindings reach."""

    def __init__(self, devices: dict[int, FakeDevice] | None = None, *,
                 set_api: bool = True, counted: bool = True,
                 properties_api: bool = False,
                 version: str = "simulated cupti-python 13.4") -> None:
        self.devices: dict[int, FakeDevice] = devices if devices is not None else {}
        #: What ``doctor`` prints as the CUPTI version of a stand-in library.
        self.version = version
        #: Whether profiler_initialize / profiler_deinitialize calls are counted (module
        #: docstring); uncounted, one deinitialise tears the profiler down for all.
        self.counted = counted
        self.collectors: list[FakeCollector] = []
        self.calls: list[tuple[int, str]] = []
        self.profiler_refs = 0
        self.driver = FakeCudaDriver(self)
        #: Called with (collector, method name) on each Collector call after any injected
        #: error (module docstring); it may raise, or queue samples on the device.
        self.on_call: Callable[[FakeCollector, str], None] | None = None
        fake = self

        class BoundCollector(FakeCollector):
            def __init__(self, device_index: int = 0) -> None:
                super().__init__(fake, device_index)

        self.pm_sampling = SimpleNamespace(
            Collector=BoundCollector, TriggerMode=TriggerMode, CounterData=CounterData
        )
        host: dict[str, Any] = {"get_supported_chips": self.get_supported_chips}
        if set_api:
            host["get_single_pass_sets"] = self.get_single_pass_sets
            host["get_metrics_in_single_pass_set"] = self.get_metrics_in_single_pass_set
        if properties_api:  # cupti-python's ProfilerHost(chip, ProfilerType.PM_SAMPLING)
            host["ProfilerType"] = ProfilerType
            host["ProfilerHost"] = lambda chip, kind, set_name=None: FakeProfilerHost(
                fake, chip, kind)
        #: Names get_metric_properties was asked about, in order.
        self.properties_asked: list[str] = []
        self.profiler_host = SimpleNamespace(**host)
        self.cupti = SimpleNamespace(cuptiError=cuptiError, Result=Result)

    def count(self, index: int, method: str) -> int:
        """How often ``method`` was called on device ``index``'s collectors."""
        return sum(1 for i, m in self.calls if (i, m) == (index, method))

    def total(self, method: str) -> int:
        """How often ``method`` was called, all devices together."""
        return sum(1 for _, m in self.calls if m == method)

    # -- process-wide profiler state, as Collector.enable()/disable() reach it ------------------

    def profiler_initialize(self, index: int) -> None:
        self.calls.append((index, "profiler_initialize"))
        self.profiler_refs = self.profiler_refs + 1 if self.counted else 1

    def profiler_deinitialize(self, index: int) -> None:
        self.calls.append((index, "profiler_deinitialize"))
        self.profiler_refs = max(0, self.profiler_refs - 1) if self.counted else 0

    def enabled(self) -> list[int]:
        """The device indices whose collector is enabled now."""
        return [c.device_index for c in self.collectors if c.enabled]

    # -- cupti.profiler_host --------------------------------------------------------------------

    def get_supported_chips(self) -> list[str]:
        return sorted({d.chip_name for d in self.devices.values()})

    def _device_of_chip(self, chip_name: str) -> FakeDevice:
        if not chip_name:
            raise ValueError("chip_name must be a non-empty string")
        for device in self.devices.values():
            if device.chip_name == chip_name:
                return device
        raise ValueError(
            f'Unsupported chip_name "{chip_name}". Use get_supported_chips() to query '
            "supported chips"
        )

    def get_single_pass_sets(self, chip_name: str) -> list[str]:
        return list(self._device_of_chip(chip_name).single_pass_sets)

    def get_metrics_in_single_pass_set(self, chip_name: str, set_name: str) -> list[str]:
        sets = self._device_of_chip(chip_name).single_pass_sets
        if not set_name:
            raise ValueError("set_name must be a non-empty string")
        if set_name not in sets:
            raise ValueError(
                f'Invalid set name "{set_name}". Use get_single_pass_sets(chip_name) to check '
                "single pass sets for a chip"
            )
        return list(sets[set_name])


class ProfilerType(enum.IntEnum):
    """``cupti.cupti.ProfilerType`` (``CUpti_ProfilerType``)."""

    RANGE_PROFILER = 0
    PM_SAMPLING = 1


class MetricType(enum.IntEnum):
    """``cupti.cupti.MetricType``."""

    COUNTER = 0
    RATIO = 1
    THROUGHPUT = 2


class MetricScope(enum.IntEnum):
    """``cupti.cupti.MetricCollectionScope``."""

    CONTEXT = 0
    INSTANCE = 1


class FakeProfilerHost:
    """``cupti.profiler_host.ProfilerHost``: ``initialize`` / ``get_metric_properties`` /
    ``deinitialize``, host side only; ValueError for a name no set or metric list offers."""

    def __init__(self, lib: FakeCupti, chip: str, kind: Any) -> None:
        self._lib, self._chip, self._kind = lib, chip, kind
        self._ready = False

    def initialize(self) -> None:
        self._lib._device_of_chip(self._chip)
        if self._kind != ProfilerType.PM_SAMPLING:
            raise ValueError(f"{self._kind!r} is not a valid ProfilerType value")
        self._ready = True

    def deinitialize(self) -> None:
        self._ready = False

    def get_metric_properties(self, metric_name: str) -> SimpleNamespace:
        if not self._ready:
            raise RuntimeError("ProfilerHost is not initialized")
        self._lib.properties_asked.append(metric_name)
        device = self._lib._device_of_chip(self._chip)
        root = base_name(metric_name)
        offered = {base_name(m) for m in device.supported_metrics}
        offered |= {base_name(m) for names in device.single_pass_sets.values() for m in names}
        if root not in offered:
            raise ValueError(f"Metric {metric_name!r} is invalid or not supported on "
                             f"{self._chip}")
        unit = device.metric_units.get(root, unit_of_name(root))
        kind = MetricType.THROUGHPUT if unit == "%" else MetricType.COUNTER
        return SimpleNamespace(description=root, hw_unit=root.partition("__")[0],
                               dim_unit=unit, metric_type=kind,
                               metric_collection_scope=MetricScope.CONTEXT)


class FakeCollector:
    """Per-device collector with the real one's state rules."""

    def __init__(self, lib: FakeCupti, device_index: int = 0) -> None:
        self._lib = lib
        self.device_index = device_index
        self.enabled = False
        self.started = False
        self.metrics: list[str] | None = None
        self.config: dict[str, Any] = {}
        self._chip_name: str | None = None
        self._pending: list[dict[str, float]] = []
        self._time = 0
        lib.collectors.append(self)

    def _outcome(self, method: str) -> None:
        device = self._lib.devices.get(self.device_index)
        outcomes = device.errors.get(method) if device is not None else None
        if outcomes:
            outcome = outcomes.pop(0)
            if outcome is not None:
                raise outcome
        if self._lib.on_call is not None:
            self._lib.on_call(self, method)

    def _call(self, method: str) -> FakeDevice:
        self._lib.calls.append((self.device_index, method))
        self._outcome(method)
        device = self._lib.devices.get(self.device_index)
        if device is None:
            raise ValueError(f"Invalid device_index: {self.device_index}")
        if self.enabled and self._lib.profiler_refs <= 0:
            # Someone deinitialised the profiler while this collector was enabled.
            raise error("ERROR_NOT_INITIALIZED")
        return device

    def enable(self) -> None:
        lib = self._lib
        lib.calls.append((self.device_index, "enable"))
        lib.profiler_initialize(self.device_index)
        try:
            self._outcome("enable")
            if not lib.driver.initialised:  # cuptiDeviceGetChipName before cuInit
                raise error("ERROR_NOT_INITIALIZED")
            device = lib.devices.get(self.device_index)
            if device is None:
                raise ValueError(f"Invalid device_index: {self.device_index}")
            if device.needs_primary_context and self.device_index not in lib.driver.retained:
                raise error("ERROR_NOT_INITIALIZED")
            if self.enabled or any(
                c.enabled and c.device_index == self.device_index for c in lib.collectors
            ):
                raise RuntimeError("PM sampling is already enabled on this device.")
            self._chip_name = device.chip_name
            self.enabled = True
        except RuntimeError:
            raise  # the real enable() re-raises these without rolling back
        except Exception:
            lib.profiler_deinitialize(self.device_index)
            self._chip_name = None
            raise

    def configure(
        self,
        *,
        metrics: list[str],
        hardware_buffer_size: int = 512 * 1024 * 1024,
        sampling_interval: int = 10000,
        trigger_mode: TriggerMode = TriggerMode.GPU_TIME_INTERVAL,
        hw_buffer_append_mode: int = 0,
        single_pass_metric_set_name: str | None = None,
    ) -> None:
        if not self.enabled:
            self._lib.calls.append((self.device_index, "configure"))
            raise RuntimeError("Collector is not enabled. Call enable() first.")
        device = self._call("configure")
        if hardware_buffer_size <= 0 or sampling_interval <= 0:
            raise ValueError("hardware_buffer_size and sampling_interval must be > 0")
        not_supported = ValueError("Requested PM sampling configuration is not supported.")
        if single_pass_metric_set_name is not None:
            offered = device.single_pass_sets.get(single_pass_metric_set_name)
            if offered is None:
                raise ValueError(
                    f"Invalid single_pass_metric_set_name {single_pass_metric_set_name!r} "
                    f"for chip {device.chip_name!r}"
                )
            bases = {base_name(m) for m in offered}
            if any(base_name(m) not in bases for m in metrics):
                raise not_supported
        else:
            unknown = [m for m in metrics if m not in device.supported_metrics]
            if unknown:
                raise ValueError(f"Invalid metrics {unknown}")
        if trigger_mode == TriggerMode.GPU_TIME_INTERVAL and not device.supports_time_interval:
            raise not_supported
        self.metrics = list(metrics)
        self.config = {
            "hardware_buffer_size": hardware_buffer_size,
            "sampling_interval": sampling_interval,
            "trigger_mode": trigger_mode,
        }
        if single_pass_metric_set_name is not None:
            self.config["single_pass_metric_set_name"] = single_pass_metric_set_name

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
            samples.append(Sample(int(record.get(START, self._time - 1)),
                                  int(record.get(END, self._time)), values))
        return CounterData(list(self.metrics), samples)

    def disable(self) -> None:
        self._lib.calls.append((self.device_index, "disable"))
        if self.enabled:  # the real disable() deinitialises only when it enabled something
            self._lib.profiler_deinitialize(self.device_index)
        self.enabled = False
        self.started = False
        self._chip_name = None


#: A DRAM sector (Nsight Compute: "an aligned 32 byte-chunk of memory").
SECTOR_BYTES = 32
#: An H200's HBM3e read peak: what a simulated read-throughput percentage is of.
DRAM_READ_PEAK_BYTES_PER_S = 4.8e12


class ClockedCupti(FakeCupti):
    """A ``FakeCupti`` whose hardware samples on a clock: one ``gh100`` device per UUID offering
    the shipped set (:func:`shipped_device`), whose ``on_call`` queues, on each ``decode``, the
    sampling intervals ``clock`` has completed since ``start``. Each interval's values come from
    two cumulative functions of (device index, time): ``instructions`` (SM instructions) and
    ``dram_read_bytes``, read as sectors of :data:`SECTOR_BYTES` and as a percentage of
    :data:`DRAM_READ_PEAK_BYTES_PER_S`, and, given ``busy_seconds`` (cumulative seconds the GPU
    was active), the GPU-activity percentage. Each sample is stamped in nanoseconds of
    ``clock``. The dry run's GPU and ``tracegen`` are both one."""

    def __init__(self, uuids: list[str], clock: Callable[[], float],
                 instructions: Callable[[int, float], float],
                 dram_read_bytes: Callable[[int, float], float],
                 sets: dict[str, Any] | None = None,
                 busy_seconds: Callable[[int, float], float] | None = None) -> None:
        super().__init__({i: shipped_device(sets, uuid=uuid) for i, uuid in enumerate(uuids)},
                         properties_api=True)
        self.clock = clock
        self.instructions = instructions
        self.dram_read_bytes = dram_read_bytes
        self.busy_seconds = busy_seconds
        self.driver.initialised = True  # CUDA is up before the sampler starts
        self._started: dict[int, tuple[float, int]] = {}  # id(collector) -> (start, emitted)
        self.on_call = self.clocked_call

    def clocked_call(self, collector: FakeCollector, method: str) -> None:
        """Note ``start``, forget at ``stop``, and queue the completed intervals at ``decode``."""
        key = id(collector)
        if method == "start":
            self._started[key] = (self.clock(), 0)
        elif method == "stop":
            self._started.pop(key, None)
        elif method == "decode" and key in self._started and collector.metrics is not None:
            start, emitted = self._started[key]
            interval = collector.config["sampling_interval"] / 1e9
            completed = math.floor((self.clock() - start) / interval + 1e-9)
            batch = []
            for k in range(emitted, completed):
                t0 = start + k * interval
                record = {name: self._value(collector.device_index, name, t0, t0 + interval)
                          for name in collector.metrics}
                record.update({START: round(t0 * 1e9), END: round((t0 + interval) * 1e9)})
                batch.append(record)
            self._started[key] = (start, max(emitted, completed))
            self.devices[collector.device_index].decodes.append(batch)

    def _value(self, index: int, metric: str, t0: float, t1: float) -> float:
        name = base_name(metric)
        if "cycles_active" in name:
            busy = self.busy_seconds
            return 0.0 if busy is None else 100.0 * (busy(index, t1) - busy(index, t0)) / (t1 - t0)
        if "inst_executed" in name:
            return self.instructions(index, t1) - self.instructions(index, t0)
        read = self.dram_read_bytes(index, t1) - self.dram_read_bytes(index, t0)
        if "throughput" in name:
            return 100.0 * read / (t1 - t0) / DRAM_READ_PEAK_BYTES_PER_S
        if name == "dramc__sectors_op_read":
            return read / SECTOR_BYTES
        return 0.0
