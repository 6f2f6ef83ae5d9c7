"""What a collector is: a name and ``update(ctx)`` returning fresh samples.

A collector raises on failure, or :class:`agent.core.hw.base.SourceUnavailable` when its source does
not apply here; the runner owns health and timing. Collectors run in a fixed order each pass
and leave what later collectors need (target CPU, GPU utilisation) in the shared context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from agent.core.hw.base import GPUIdentity
from agent.core.targets import Target
from exporters.exposition.snapshot import Sample


@dataclass
class TargetState:
    """What the process collector learned about one target this pass."""

    pid: int
    process: str
    user_ratio: float | None = None
    hottest_thread_user_ratio: float | None = None


@dataclass
class SampleContext:
    """Shared state of one sampling pass."""

    now: float  # monotonic seconds
    wall: float  # Unix seconds
    targets: list[Target]
    #: Filled by the process collector, keyed by PID.
    processes: dict[int, TargetState] = field(default_factory=dict)
    #: Filled by the gpu collector: latest utilisation and fine-grained points per GPU.
    gpu_util: dict[GPUIdentity, float] = field(default_factory=dict)
    gpu_util_points: dict[GPUIdentity, list[tuple[float, float]]] = field(default_factory=dict)
    #: GPUs on which each target PID holds memory.
    gpus_of_pid: dict[int, set[GPUIdentity]] = field(default_factory=dict)


class Collector(Protocol):
    name: str

    def update(self, ctx: SampleContext) -> list[Sample]:
        """Sample the source and return the samples of this pass."""
        ...
