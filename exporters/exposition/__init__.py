"""The agent's exposition: the snapshot collector that turns the sampler's latest snapshot into
metric families, and the HTTP server for ``/metrics``, ``/healthz`` and ``/readyz``.

Used by the sidecar (:mod:`mrc_agent.agent.core.wiring`); MRC services use
:mod:`mrc_agent.exporters.instrumentation` instead.
"""
