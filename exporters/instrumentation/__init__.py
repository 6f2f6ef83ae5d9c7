"""The instrumentation library for MRC services: request metrics by prompt length × image
resolution, time to first token, stage timings, cache and chain-break metrics, and the ASGI
``/metrics`` endpoint (multiprocess-aware).

Used by MRC services such as :mod:`reference_service`; its public API is importable from here
(``from exporters.instrumentation import MRCMetrics, metrics_endpoint``). The agent's own
exposition is :mod:`exporters.exposition`; the two halves share only :mod:`exporters.render`.
"""

from exporters.instrumentation import buckets
from exporters.instrumentation.asgi import (
    exposition_registry,
    metrics_app,
    metrics_endpoint,
    metrics_route,
)
from exporters.instrumentation.metrics import (
    FAMILIES,
    MRCMetrics,
    Outcome,
    RequestTracker,
    Stage,
    mark_process_dead,
    multiprocess_enabled,
    outcome_for_status,
    prepare_multiproc_dir,
)

__all__ = [
    "FAMILIES",
    "MRCMetrics",
    "Outcome",
    "RequestTracker",
    "Stage",
    "buckets",
    "exposition_registry",
    "mark_process_dead",
    "metrics_app",
    "metrics_endpoint",
    "metrics_route",
    "multiprocess_enabled",
    "outcome_for_status",
    "prepare_multiproc_dir",
]
