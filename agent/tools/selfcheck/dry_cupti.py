"""The dry run's CUPTI stand-in: ``cupti.pm_sampling``, ``cupti.profiler_host`` and
``cupti.cupti`` over a :class:`~.dry.DryModel`, offering what an H200 offers.

The chip is ``gh100`` with its one single-pass set, ``Compute_Triage``, as ``libcupti.so.13``
13.4.92 ships it: :data:`GH100_SETS_FILE` (``data/gh100_pm_sampling.json``) holds that set's
metric list and user metrics, written from ``tests/data/cupti_sets/cupti-13.4.92.json`` by
``python3 -m mrc_agent.agent.tools.selfcheck.dry_cupti SOURCE.json`` (a test checks it still
equals that file's GH100 entry). The answers follow cupti-python 13.4's sources:

- ``profiler_host.get_supported_chips()``; ``get_single_pass_sets(chip)`` and
  ``get_metrics_in_single_pass_set(chip, set)`` raise ValueError for a chip not listed, the
  latter also for an unknown set;
- ``ProfilerHost(chip, ProfilerType.PM_SAMPLING).initialize()`` then
  ``get_metric_properties(name)`` (ValueError for a name the chip lacks);
- ``Collector.configure`` raises ValueError for any metric the set does not offer (the real
  one's ``create_config_image`` does), e.g. ``dram__bytes_read.sum``, which no chip has.

A metric is offered when its name, less a rollup suffix (``.sum``, ``.avg.pct_of_...``), is in
the set's list: ``dramc__sectors_op_read.sum`` and
``Compute_Triage.dramc__read_throughput.avg.pct_of_peak_sustained_elapsed`` are. The values:
SM instructions, DRAM read sectors (32 bytes each) and the read throughput as a percentage of
:data:`DRAM_READ_PEAK_BYTES_PER_S`, integrated from the model over each completed interval.
"""

from __future__ import annotations

import enum
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mrc_agent.agent.tools.selfcheck.dry import DryModel

GH100_SETS_FILE = Path(__file__).resolve().parents[1] / "data" / "gh100_pm_sampling.json"
CHIP = "gh100"
#: A DRAM sector (Nsight Compute: "an aligned 32 byte-chunk of memory").
SECTOR_BYTES = 32
#: The simulated H200's HBM3e read peak: what the throughput percentage is of.
DRAM_READ_PEAK_BYTES_PER_S = 4.8e12
#: Rollups CUPTI appends to a base metric (Nsight Compute's metric naming).
_ROLLUPS = ("sum", "avg", "min", "max")


def load_sets(path: Path = GH100_SETS_FILE) -> dict[str, Any]:
    """The shipped GH100 set: ``{"cupti", "chip", "set", "metrics", "user_metrics"}``."""
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def extract(source: dict[str, Any], chip: str = CHIP) -> dict[str, Any]:
    """The shipped file's content from one ``tests/data/cupti_sets`` file."""
    entries = [s for s in source["sets"] if chip in s["chips"]]
    if len(entries) != 1:
        raise ValueError(f"{chip}: expected one set, found {len(entries)}")
    entry = entries[0]
    return {"cupti": source["cupti"], "chip": chip, "set": entry["set"],
            "metrics": list(entry["metrics"]), "user_metrics": sorted(entry["user_metrics"])}


def offered_name(metric: str, offered: set[str]) -> str | None:
    """The set's entry ``metric`` configures (itself or less its rollup), else None."""
    if metric in offered:
        return metric
    parts = metric.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if parts[cut] in _ROLLUPS and ".".join(parts[:cut]) in offered:
            return ".".join(parts[:cut])
    return None


class _Result(enum.IntEnum):
    """The CUptiResult codes the sampler names (values from cupti_result.h)."""

    SUCCESS = 0
    ERROR_INVALID_DEVICE = 2
    ERROR_UNKNOWN = 999


class _CuptiError(Exception):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"{_Result(status).name} ({int(status)})")


class _TriggerMode(enum.IntEnum):
    GPU_SYSCLK_INTERVAL = 0
    GPU_TIME_INTERVAL = 1


class _ProfilerType(enum.IntEnum):
    RANGE_PROFILER = 0
    PM_SAMPLING = 1


@dataclass(frozen=True)
class _MetricProperties:
    description: str
    hw_unit: str
    dim_unit: str
    metric_type: Any
    metric_collection_scope: Any


class _MetricType(enum.IntEnum):
    COUNTER = 0
    RATIO = 1
    THROUGHPUT = 2


class _Scope(enum.IntEnum):
    CONTEXT = 0
    INSTANCE = 1


@dataclass(frozen=True)
class _PmSample:
    metric_values: list[float]


@dataclass
class _CounterData:
    metrics: list[str]
    samples: list[_PmSample]

    def __iter__(self) -> Iterator[_PmSample]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)


class _Host:
    """``cupti.profiler_host`` over the shipped set."""

    ProfilerType = _ProfilerType

    def __init__(self, sets: dict[str, Any]) -> None:
        self._sets = sets
        self.offered = set(sets["metrics"]) | set(sets["user_metrics"])

    def _chip(self, chip: str) -> None:
        if chip not in self.get_supported_chips():
            raise ValueError(f'Unsupported chip_name "{chip}". Use get_supported_chips() to '
                             "query supported chips")

    def get_supported_chips(self) -> list[str]:
        return [self._sets["chip"]]

    def get_single_pass_sets(self, chip_name: str) -> list[str]:
        self._chip(chip_name)
        return [self._sets["set"]]

    def get_metrics_in_single_pass_set(self, chip_name: str, set_name: str) -> list[str]:
        self._chip(chip_name)
        if set_name != self._sets["set"]:
            raise ValueError(f'Invalid set name "{set_name}". Use get_single_pass_sets('
                             "chip_name) to check single pass sets for a chip")
        return list(self._sets["metrics"])

    def ProfilerHost(self, chip_name: str, profiler_type: Any,  # noqa: N802 (the real name)
                     single_pass_metric_set_name: str | None = None) -> _ProfilerHost:
        return _ProfilerHost(self, chip_name, single_pass_metric_set_name)


class _ProfilerHost:
    def __init__(self, host: _Host, chip: str, set_name: str | None) -> None:
        self._host, self._chip, self._set = host, chip, set_name
        self._ready = False

    def initialize(self) -> None:
        self._host._chip(self._chip)
        if self._set is not None and self._set != self._host._sets["set"]:
            raise ValueError(f"Invalid single_pass_metric_set_name {self._set!r} for chip "
                             f"{self._chip!r}")
        self._ready = True

    def deinitialize(self) -> None:
        self._ready = False

    def get_metric_properties(self, metric_name: str) -> _MetricProperties:
        if not self._ready:
            raise RuntimeError("Call initialize() before using this object.")
        name = offered_name(metric_name, self._host.offered)
        if name is None:
            raise ValueError(f"Metric {metric_name!r} is invalid or not supported on {self._chip}")
        if "throughput" in name:
            return _MetricProperties("DRAM read throughput (dry run)", "dramc", "%",
                                     _MetricType.THROUGHPUT, _Scope.CONTEXT)
        unit = "sectors" if "sectors" in name else "inst" if "inst" in name else ""
        return _MetricProperties(f"{name} (dry run)", name.partition("__")[0], unit,
                                 _MetricType.COUNTER, _Scope.CONTEXT)


class _DryCollector:
    """``cupti.pm_sampling.Collector`` over the model: intervals complete on the clock."""

    def __init__(self, model: DryModel, host: _Host, device_index: int) -> None:
        if not 0 <= device_index < model.gpus:
            raise ValueError(f"Invalid device_index: {device_index}")
        self._model, self._host = model, host
        self._gpu = device_index
        self._metrics: list[str] = []
        self._interval = 0.1
        self._start: float | None = None
        self._next = 0
        self._chip_name: str | None = None

    def enable(self) -> None:
        if self._model.faults.cupti_refused:
            # What cupti-python's enable() raises for CUPTI_ERROR_INSUFFICIENT_PRIVILEGES.
            raise PermissionError("Insufficient privileges to enable PM sampling")
        self._chip_name = CHIP  # what the real enable() sets from cuptiDeviceGetChipName

    def configure(self, *, metrics: list[str], hardware_buffer_size: int,
                  sampling_interval: int, trigger_mode: int,
                  single_pass_metric_set_name: str | None = None) -> None:
        if self._chip_name is None:
            raise RuntimeError("Collector is not enabled. Call enable() first.")
        set_name = self._host._sets["set"]
        if single_pass_metric_set_name not in (None, set_name):
            raise ValueError(f"Invalid single_pass_metric_set_name "
                             f"{single_pass_metric_set_name!r} for chip {CHIP!r}")
        unknown = [m for m in metrics if offered_name(m, self._host.offered) is None]
        if unknown:
            raise ValueError(f"One or more metrics in {unknown!r} are invalid or not supported "
                             f"on {CHIP}")
        self._metrics = list(metrics)
        self._interval = sampling_interval / 1e9

    def start(self) -> None:
        self._start = self._model.clock()
        self._next = 0

    def _value(self, metric: str, t0: float, t1: float) -> float:
        m, gpu = self._model, self._gpu
        name = offered_name(metric, self._host.offered) or metric
        if "inst_executed" in name:
            return m.instructions(gpu, t1) - m.instructions(gpu, t0)
        read = m.dram_read_bytes(gpu, t1) - m.dram_read_bytes(gpu, t0)
        if "throughput" in name:
            return 100.0 * read / (t1 - t0) / DRAM_READ_PEAK_BYTES_PER_S
        if name == "dramc__sectors_op_read":
            return read / SECTOR_BYTES
        return 0.0

    def decode(self, max_samples: int = 10000) -> _CounterData:
        if self._start is None:
            raise RuntimeError("PM Sampling collection has not started")
        completed = math.floor((self._model.clock() - self._start) / self._interval)
        upto = min(completed, self._next + max_samples)
        samples = []
        for k in range(self._next, upto):
            t0 = self._start + k * self._interval
            t1 = t0 + self._interval
            samples.append(_PmSample([self._value(m, t0, t1) for m in self._metrics]))
        self._next = max(self._next, upto)
        return _CounterData(list(self._metrics), samples)

    def stop(self) -> None:
        self._start = None

    def disable(self) -> None:
        self._chip_name = None


class DryCupti:
    """Stands in for the ``cupti`` package (``.pm_sampling``, ``.profiler_host``, ``.cupti``)
    over a model."""

    def __init__(self, model: DryModel, sets: dict[str, Any] | None = None) -> None:
        host = _Host(sets or load_sets())

        def collector(device_index: int = 0) -> _DryCollector:
            return _DryCollector(model, host, device_index)

        self.pm_sampling = SimpleNamespace(Collector=collector, TriggerMode=_TriggerMode)
        self.profiler_host = host
        self.cupti = SimpleNamespace(cuptiError=_CuptiError, Result=_Result)


def main(argv: list[str]) -> int:
    """Rewrite :data:`GH100_SETS_FILE` from a ``tests/data/cupti_sets`` file."""
    if len(argv) != 1:
        print("usage: python3 -m mrc_agent.agent.tools.selfcheck.dry_cupti "
              "tests/data/cupti_sets/cupti-13.4.92.json", file=sys.stderr)
        return 2
    data = extract(json.loads(Path(argv[0]).read_text(encoding="utf-8")))
    GH100_SETS_FILE.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"{GH100_SETS_FILE}: {len(data['metrics'])} metrics, "
          f"{len(data['user_metrics'])} user metrics")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
