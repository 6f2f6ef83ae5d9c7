"""On-alert capture: Alertmanager webhooks start a diagnosis of the alerting target in the
background, and the agent lists and serves the results.

Endpoints (served beside ``/metrics`` by
:class:`mrc_agent.exporters.exposition.http.ExpositionServer`):

* ``POST /hooks/alertmanager`` — Alertmanager webhook payload, version 4;
* ``POST /captures`` — a capture asked for by hand (``mrc-agent diagnose --agent``): the same
  diagnosis of one target, ``{"pid": N, "duration": S}``;
* ``GET /captures`` — the captures as JSON, newest first, with the limits and counters;
* ``GET /captures/<id>`` — one capture's metadata;
* ``GET /captures/<id>/<file>`` — one file of a capture (flame graph, stacks, samples, report).

All of them exist only when a shared token is configured (off by default: 404 otherwise), and
all of them need ``Authorization: Bearer <token>``, compared in constant time; a missing or
wrong token gets 401 and starts nothing. Captures hold the target's stacks and function names,
hence the token on the read side too.

For firing ``MRCGPUStarved`` and ``MRCProcessCPUUserSaturated`` alerts whose ``pid`` label names a
target of this agent (or, without a ``pid`` label, the agent's hottest target) and whose ``pod``
label, if any, is this host's name, one capture runs :func:`mrc_agent.agent.tools.diagnose.diagnose`
in a thread. At most one runs at a time and at most ``capture_max_per_hour`` start per rolling hour;
more requests are answered 202 ``rate-limited`` and counted. The captures directory is bounded by
count, bytes and age, the oldest captures going first.

The rooms, each importing only those before it:

* :mod:`~mrc_agent.agent.tools.capture.webhook`: the bearer token and the webhook payload;
* :mod:`~mrc_agent.agent.tools.capture.store`: the captures directory and its limits;
* :mod:`~mrc_agent.agent.tools.capture.manager`: running captures, one at a time, rate-limited;
* :mod:`~mrc_agent.agent.tools.capture.api`: the HTTP endpoints and their wiring into the agent's
server.

The package exports the routes factory ``mrc-agent run`` takes (:func:`build_capture_api`);
the rest is imported from its room.
"""

from __future__ import annotations

from mrc_agent.agent.tools.capture.api import build_capture_api

__all__ = ["build_capture_api"]
