"""The agent's HTTP server: :class:`ExpositionServer` (``server``), its connection policy
(``connections``), its wire (``wire``: h11 parses, the server answers) and what extra routes
and authenticators implement (``routes``). The limits are in
:mod:`mrc_agent.exporters.exposition.limits`."""

from mrc_agent.exporters.exposition.http.routes import Authenticator, Request, Response, Routes
from mrc_agent.exporters.exposition.http.server import ExpositionServer
from mrc_agent.exporters.exposition.limits import Limits

__all__ = ["Authenticator", "ExpositionServer", "Limits", "Request", "Response", "Routes"]
