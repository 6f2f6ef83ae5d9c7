"""What the exposition server serves beside its own paths, and who it lets in: the request and
response an extra route sees, the :class:`Routes` protocol (the agent's webhook and captures
implement it) and the :class:`Authenticator` protocol (the web configuration's basic auth)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Request:
    """What an extra route sees: method, path as sent (query removed), lower-cased headers."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes = b""


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class Routes(Protocol):
    """Extra endpoints served beside ``/metrics``. A class states that it is one by naming
    this protocol among its bases; it then inherits the defaults of :meth:`checks_own_bearer`
    (no path guards itself) and :meth:`stop` (nothing to stop)."""

    #: Largest request body read; a bigger declared ``Content-Length`` gets 413 unread.
    max_body_bytes: int

    def handle(self, request: Request) -> Response | None:
        """The response, or None when the path is not one of these routes (the server then
        answers 404 to GET/HEAD and 405 to POST, as without routes). Runs in a worker thread:
        it may read files."""
        ...

    def checks_own_bearer(self, path: str) -> bool:
        """True for a path whose requests carry a bearer token that :meth:`handle` checks
        itself: the web configuration's basic auth then does not apply to a request to it
        that carries a bearer token (Alertmanager's webhook sends one credential only)."""
        return False

    def stop(self) -> None:
        """End what the routes run in the background; called once, when the agent stops."""
        return None


class Authenticator(Protocol):
    """Decides whether a request's ``Authorization`` header lets it in."""

    def cached(self, authorization: str | None) -> bool | None:
        """The answer when it costs nothing (no credentials, malformed ones, a check that
        already passed); None when only :meth:`check` can tell."""
        ...

    def check(self, authorization: str | None) -> bool:
        """The full check. It may take tens of milliseconds (bcrypt), so the server runs it
        in its own worker thread, never on the event loop."""
        ...

    def failure_floor_s(self) -> float:
        """The least time from the start of a failed check to its answer; the server waits
        out the rest on the loop, so that a wrong password takes as long for every user."""
        return 0.0
