"""The agent's metric catalogue: every metric the sidecar exports, assembled from the
declarations beside the code that emits them (the runner's own, each registered pass
finisher's and each registered collector's): no metric is listed here by hand. It drives the
exposition and the generated ``docs/metrics.md``.

Names follow ``mrc_<subsystem>_<name>_<unit>[_total]`` with base units. Every label is bounded
(GPU index/UUID/model, target PID and process name, a fixed ``mode``/``kind``/``link`` set). The
names the dashboards and alert rules use are a contract and must not change.
"""

from __future__ import annotations

from mrc_agent.agent.core import runner
from mrc_agent.agent.core.collectors import COLLECTORS, FINISHERS
from mrc_agent.exporters.exposition.snapshot import MetricSpec

CATALOG: list[MetricSpec] = [
    *runner.METRICS,
    *(spec for f in FINISHERS for spec in f.metrics),
    *(spec for c in COLLECTORS for spec in c.metrics),
]
