"""The collectors, registered in sampling order.

Each collector module declares its name, default, factory and metrics in one
:class:`~mrc_agent.agent.core.collectors.base.CollectorDef` beside the code that emits them. This
list is the sampling order; :func:`~mrc_agent.agent.core.collectors.base.check_order` fails at
import when a collector would run before one whose output it reads (derived reads the process
collector's ``Processes`` and the gpu collector's ``GpuReadings``).
"""

from __future__ import annotations

from mrc_agent.agent.core.collectors import derived, gpm, gpu, process, profiling, stacks
from mrc_agent.agent.core.collectors.base import (
    CollectorDef,
    FinisherDef,
    PassFinisher,
    check_order,
)

COLLECTORS: tuple[CollectorDef, ...] = check_order([
    process.DEFINITION,
    gpu.DEFINITION,
    gpm.DEFINITION,
    profiling.DEFINITION,
    derived.DEFINITION,
    stacks.DEFINITION,
])
BY_NAME = {c.name: c for c in COLLECTORS}
COLLECTOR_NAMES: tuple[str, ...] = tuple(BY_NAME)
DEFAULT_ON: dict[str, bool] = {c.name: c.default_on for c in COLLECTORS}
#: Run after every collector in each pass, in this order.
FINISHERS: tuple[FinisherDef, ...] = (profiling.FINISHER, gpu.FINISHER)
PASS_FINISHERS: tuple[PassFinisher, ...] = tuple(f.finish for f in FINISHERS)
