"""Prometheus exposition, in two halves that share one renderer (:mod:`mrc_agent.exporters.render`):

* :mod:`mrc_agent.exporters.exposition` — the sidecar agent's exposition: the snapshot collector and
the
  HTTP server behind ``mrc-agent run``'s ``/metrics``, ``/healthz`` and ``/readyz``;
* :mod:`mrc_agent.exporters.instrumentation` — the library an MRC service imports for its request
  metrics and its own ``/metrics`` endpoint.

Depends only on prometheus-client (and starlette for the service endpoint), never on the
agent's internals or on torch.
"""
