"""The instrumentation library for MRC services: request metrics by prompt length × image
resolution, time to first token, stage timings, cache and chain-break metrics, and the ASGI
``/metrics`` endpoint (multiprocess-aware).

Used by MRC services such as :mod:`reference_service`; its public API is importable from here
(``from exporters.instrumentation import MRCMetrics, metrics_endpoint``). The agent's own exposition
is :mod:`mrc_agent.exporters.exposition`; the two halves share only
:mod:`mrc_agent.exporters.render`.

Its rooms: :mod:`~mrc_agent.exporters.instrumentation.families` (the contract: names, labels, label
values), :mod:`~mrc_agent.exporters.instrumentation.buckets` (boundaries and label edges),
:mod:`~mrc_agent.exporters.instrumentation.metrics` (``MRCMetrics`` and ``RequestTracker``),
:mod:`~mrc_agent.exporters.instrumentation.stores` (where the values live, per mode),
:mod:`~mrc_agent.exporters.instrumentation.multiprocess` (the multiprocess-mode helpers) and
:mod:`~mrc_agent.exporters.instrumentation.asgi` (``GET /metrics``; Starlette, loaded on first use).
The OpenAI meter, for servers that do not import the library, is
:mod:`~mrc_agent.exporters.instrumentation.meter` (what it reads from the wire),
:mod:`~mrc_agent.exporters.instrumentation.jsonscan` (how, in bounded work) and
:mod:`~mrc_agent.exporters.instrumentation.middleware` (``MRCMeterMiddleware``, the ASGI way in;
``mrc-agent proxy`` is the other).
"""

from typing import Any

from mrc_agent.exporters.instrumentation import buckets
from mrc_agent.exporters.instrumentation.families import (
    CHAIN_BREAK_STEPS,
    FAMILIES,
    LATENCY_OUTCOMES,
    MODEL_INFO_LABELS,
    OUTCOMES,
    STAGES,
    ChainBreakStep,
    Family,
    Outcome,
    Stage,
    outcome_for_status,
)
from mrc_agent.exporters.instrumentation.metrics import MRCMetrics, RequestTracker
from mrc_agent.exporters.instrumentation.middleware import MRCMeterMiddleware
from mrc_agent.exporters.instrumentation.multiprocess import (
    mark_process_dead,
    multiprocess_enabled,
    prepare_multiproc_dir,
)

__all__ = [
    "CHAIN_BREAK_STEPS",
    "FAMILIES",
    "LATENCY_OUTCOMES",
    "MODEL_INFO_LABELS",
    "OUTCOMES",
    "STAGES",
    "ChainBreakStep",
    "Family",
    "MRCMeterMiddleware",
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

#: The ``/metrics`` helpers import Starlette, which the proxy's light sidecar does not have: they
#: load on first use.
_ASGI = frozenset({"exposition_registry", "metrics_app", "metrics_endpoint", "metrics_route"})


def __getattr__(name: str) -> Any:
    if name in _ASGI:
        from mrc_agent.exporters.instrumentation import asgi
        return getattr(asgi, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
