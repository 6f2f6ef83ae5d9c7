"""The instrumentation library for MRC services: request metrics by prompt length × image
resolution, time to first token, stage timings, cache and chain-break metrics, and the ASGI
``/metrics`` endpoint (multiprocess-aware).

Used by MRC services such as :mod:`reference_service`; its public API is importable from here
(``from exporters.instrumentation import MRCMetrics, metrics_endpoint``). The agent's own
exposition is :mod:`exporters.exposition`; the two halves share only :mod:`exporters.render`.
"""
