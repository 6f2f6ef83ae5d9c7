"""The HTTP side (:class:`CaptureAPI`): ``POST /hooks/alertmanager`` and ``GET /captures...``
behind the bearer token. :func:`build_capture_api` is the routes factory ``mrc-agent run`` hands to
the core (:func:`mrc_agent.agent.core.run.run_agent`), which serves the routes beside ``/metrics``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any

from mrc_agent.agent.core.config import CAPTURE_DURATION_RANGE, AgentConfig, ConfigError
from mrc_agent.agent.core.runner import Runner
from mrc_agent.agent.tools.capture.manager import CaptureManager
from mrc_agent.agent.tools.capture.store import CaptureStore
from mrc_agent.agent.tools.capture.webhook import MAX_BODY_BYTES, Token, WebhookError, parse_webhook
from mrc_agent.agent.tools.diagnose.pyspy import PySpyError, find_py_spy
from mrc_agent.exporters.exposition.http import Request, Response, Routes

log = logging.getLogger(__name__)


CAPTURE_ALERTS = frozenset({"MRCGPUStarved", "MRCProcessCPUUserSaturated"})
#: What a capture asked for with ``POST /captures`` (``mrc-agent diagnose --agent``) is filed as.
MANUAL = "manual"
#: A requested capture's window, seconds: the bounds of ``--capture-duration``.
MIN_DURATION, MAX_DURATION = CAPTURE_DURATION_RANGE


_CONTENT_TYPES = {
    ".svg": "image/svg+xml",
    ".json": "application/json",
    ".jsonl": "application/x-ndjson",
    ".csv": "text/csv; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
}
#: The flame graph's search and zoom are inline script: allowed, nothing else (no network).
_FILE_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                               "style-src 'unsafe-inline'",
    "Cache-Control": "no-store",
}


def _json(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(status, (json.dumps(obj, indent=1) + "\n").encode(), "application/json",
                    {"Cache-Control": "no-store", **(headers or {})})


class CaptureAPI(Routes):
    """The webhook and captures endpoints.
    With ``manager`` None the feature is off and every one of its paths is 404."""

    max_body_bytes = MAX_BODY_BYTES

    def __init__(self, manager: CaptureManager | None, token: Token | None,
                 hostname: str | None = None) -> None:
        self.manager = manager
        self.token = token
        #: PIDs are per pod (shareProcessNamespace): an alert about pid 7 of another pod must
        #: not capture our pid 7. A pod's hostname is its name unless spec.hostname is set.
        self.hostname = hostname or socket.gethostname()

    def stop(self) -> None:
        """Stop a capture in progress (at shutdown)."""
        if self.manager is not None:
            self.manager.stop()

    @staticmethod
    def _ours(path: str) -> bool:
        return path in ("/hooks/alertmanager", "/captures") or path.startswith("/captures/")

    def checks_own_bearer(self, path: str) -> bool:
        """Every path here is behind the bearer token (checked in :meth:`handle`)."""
        return self.token is not None and self._ours(path)

    def handle(self, request: Request) -> Response | None:
        path = request.path
        if not self._ours(path):
            return None
        if self.manager is None or self.token is None:
            return _json(404, {"error": "not found (the webhook is not enabled)"})
        if not self.token.check(request.headers.get("authorization")):
            self.manager.count("unauthorized")
            return _json(401, {"error": "missing or wrong bearer token"},
                         {"WWW-Authenticate": 'Bearer realm="mrc-agent"'})
        if path == "/hooks/alertmanager":
            if request.method != "POST":
                return _json(405, {"error": "use POST"}, {"Allow": "POST"})
            return self._webhook(request.body)
        if path == "/captures" and request.method == "POST":
            return self._requested(request.body)
        if request.method not in ("GET", "HEAD"):
            return _json(405, {"error": "use GET"}, {"Allow": "GET, HEAD"})
        return self._captures(path)

    def _requested(self, body: bytes) -> Response:
        """``POST /captures`` with ``{"pid": N, "duration": S}`` (both optional: the hottest
        target, the configured window): a capture asked for by hand, as ``mrc-agent diagnose
        --agent`` does. 202 accepted, 400 a bad body, 404 a pid that is not a target, 429
        while one runs or past the hourly limit, 503 when the directory cannot take it."""
        assert self.manager is not None
        m = self.manager
        try:
            asked = json.loads(body or b"{}")
        except (ValueError, UnicodeDecodeError):
            asked = None
        if not isinstance(asked, dict) or set(asked) - {"pid", "duration"}:
            m.count("invalid")
            return _json(400, {"error": 'the body must be a JSON object with at most "pid" '
                                        'and "duration"'})
        pid, duration = asked.get("pid"), asked.get("duration")
        if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool)):
            m.count("invalid")
            return _json(400, {"error": '"pid" must be a whole number'})
        if duration is not None and (
                not isinstance(duration, (int, float)) or isinstance(duration, bool)
                or not MIN_DURATION <= duration <= MAX_DURATION):
            m.count("invalid")
            return _json(400, {"error": f'"duration" must be {MIN_DURATION:g}-'
                                        f"{MAX_DURATION:g} seconds"})
        m.prune()
        if pid is None:
            pid = m.hottest_target()
            if pid is None:
                return _json(404, {"error": "the agent has no target"})
        elif pid not in m.targets():
            return _json(404, {"error": f"pid {pid} is not a target of this agent"})
        result, detail = m.request(MANUAL, pid, None if duration is None else float(duration))
        if result == "accepted":
            return _json(202, {"status": result, "capture": detail, "pid": pid,
                               "url": f"/captures/{detail}"})
        return _json(429 if result == "rate-limited" else 503,
                     {"status": result, "reason": detail})

    def _webhook(self, body: bytes) -> Response:
        assert self.manager is not None
        m = self.manager
        try:
            alerts = parse_webhook(body)
        except WebhookError as exc:
            m.count("invalid")
            return _json(400, {"error": f"not an Alertmanager webhook payload: {exc}"})
        m.prune()
        outcomes: list[dict[str, Any]] = []
        status, capture = "ignored", None
        watched: list[int] | None = None
        for alert in alerts:
            row: dict[str, Any] = {"alertname": alert.name, "status": alert.status}
            outcomes.append(row)
            if alert.status != "firing" or alert.name not in CAPTURE_ALERTS:
                row["outcome"] = "ignored: not a firing " + " or ".join(sorted(CAPTURE_ALERTS))
                continue
            pod = alert.labels.get("pod")
            if pod is not None and pod != self.hostname:
                row["outcome"] = f"ignored: pod {pod[:64]!r} is not this agent's pod"
                continue
            watched = m.targets() if watched is None else watched
            raw = alert.labels.get("pid")
            if raw is None:
                pid = m.hottest_target()
                if pid is None:
                    row["outcome"] = "ignored: no pid label and the agent has no target"
                    continue
            # ASCII digits of a plausible length: "²" passes isdigit() and int() refuses it.
            elif not (raw.isascii() and raw.isdigit() and len(raw) <= 7) or (
                    int(raw) not in watched):
                row["outcome"] = f"ignored: pid {raw[:16]!r} is not a target of this agent"
                continue
            else:
                pid = int(raw)
            row["pid"] = pid
            result, detail = m.request(alert.name, pid)
            row["outcome"] = result
            if result == "accepted":
                status, capture = "accepted", detail
                row["capture"] = detail
            else:
                row["reason"] = detail
                if status == "ignored":
                    status = result
        if status == "ignored":
            m.count("ignored")
        reply: dict[str, Any] = {"status": status, "alerts": outcomes}
        if capture is not None:
            reply["capture"] = capture
            reply["url"] = f"/captures/{capture}"
        code = {"ignored": 200, "error": 503}.get(status, 202)
        return _json(code, reply)

    def _captures(self, path: str) -> Response:
        assert self.manager is not None
        m = self.manager
        parts = path.split("/")
        if path == "/captures":
            m.prune()
            count, used = m.store.usage()
            captures: list[dict[str, Any]] = []
            for meta in m.store.entries():
                row: dict[str, Any] = {k: meta.get(k) for k in ("id", "alert", "pid")}
                row["started"] = meta.get("started_at")
                row.update({k: meta[k] for k in ("status", "verdict", "summary", "finished_at",
                                                 "error", "files", "bytes") if k in meta})
                captures.append(row)
            return _json(200, {
                "captures": captures, "running": m.running,
                "limits": {"max_count": m.store.max_count, "max_bytes": m.store.max_bytes,
                           "retention_seconds": m.store.retention_s,
                           "max_per_hour": m.max_per_hour, "duration_seconds": m.duration},
                "usage": {"count": count, "bytes": used},
                "counts": dict(m.counts)})
        if len(parts) == 3:
            one = m.store.meta(parts[2])
            return _json(200, one) if one else _json(404, {"error": "no such capture"})
        if len(parts) == 4:
            full = m.store.file_path(parts[2], parts[3])
            if full is not None:
                try:
                    with open(full, "rb") as f:
                        data = f.read()
                except OSError:
                    data = None
                if data is not None:
                    ext = os.path.splitext(full)[1]
                    return Response(200, data, _CONTENT_TYPES.get(ext, "application/octet-stream"),
                                    dict(_FILE_HEADERS))
        return _json(404, {"error": "no such capture file"})


# -- wiring ------------------------------------------------------------------------------------
def build_capture_api(cfg: AgentConfig, runner: Runner) -> CaptureAPI:
    """The endpoints for ``cfg``: off (404) without a token. Raises ConfigError for an
    unreadable token file or capture directory."""
    if not cfg.webhook_enabled:
        return CaptureAPI(None, None)
    token = Token(path=cfg.webhook_token_file) if cfg.webhook_token_file else Token(
        value=cfg.webhook_token)
    try:
        store = CaptureStore(cfg.capture_dir, cfg.capture_max_count, cfg.capture_max_bytes,
                             cfg.capture_retention)
        store.prune()
    except OSError as exc:
        raise ConfigError(f"capture-dir {cfg.capture_dir}: {exc.strerror or exc}") from exc
    try:
        find_py_spy()
    except PySpyError as exc:
        log.warning("webhook enabled but captures will fail: %s", exc)
    log.info("Alertmanager webhook enabled on /hooks/alertmanager; captures of %.3g s in %s "
             "(at most %d per hour, %d kept, %d bytes, %.0f s retention)", cfg.capture_duration,
             cfg.capture_dir, cfg.capture_max_per_hour, cfg.capture_max_count,
             cfg.capture_max_bytes, cfg.capture_retention)
    return CaptureAPI(CaptureManager(cfg, store, runner), token)
