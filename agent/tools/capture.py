"""On-alert capture: Alertmanager webhooks start a diagnosis of the alerting target in the
background, and the agent lists and serves the results.

Endpoints (served beside ``/metrics`` by :class:`exporters.exposition.http.ExpositionServer`):

* ``POST /hooks/alertmanager`` — Alertmanager webhook payload, version 4;
* ``GET /captures`` — the captures as JSON, newest first, with the limits and counters;
* ``GET /captures/<id>`` — one capture's metadata;
* ``GET /captures/<id>/<file>`` — one file of a capture (flame graph, stacks, samples, report).

All of them exist only when a shared token is configured (off by default: 404 otherwise), and
all of them need ``Authorization: Bearer <token>``, compared in constant time; a missing or
wrong token gets 401 and starts nothing. Captures hold the target's stacks and function names,
hence the token on the read side too.

For firing ``MRCGPUStarved`` and ``MRCProcessCPUUserSaturated`` alerts whose ``pid`` label
names a target of this agent (or, without a ``pid`` label, the agent's hottest target) and
whose ``pod`` label, if any, is this host's name, one capture runs
:func:`agent.tools.diagnose.diagnose` in a thread. At most one runs at a time and at most
``capture_max_per_hour`` start per rolling hour; more requests are answered 202
``rate-limited`` and counted. The captures directory is bounded by count, bytes and age, the
oldest captures going first.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.core.catalog import COLLECTORS
from agent.core.collectors.base import Collector
from agent.core.config import AgentConfig, ConfigError, read_token_file
from agent.core.runner import Runner
from agent.tools.diagnose import FILES, Borrowed, PySpyError, diagnose, find_py_spy
from exporters.exposition.http import ExpositionServer, Request, Response

log = logging.getLogger(__name__)

CAPTURE_ALERTS = frozenset({"MRCGPUStarved", "MRCProcessCPUUserSaturated"})
#: Alertmanager sends every alert of a group in one payload; 1 MiB holds hundreds (set
#: ``max_alerts`` on the webhook receiver to stay well inside it).
MAX_BODY_BYTES = 1 << 20
MAX_ALERTS = 1000
#: Sampling period of the collectors during a capture: five points a second shows sub-second
#: GPU idle gaps next to the CPU that causes them.
CAPTURE_INTERVAL = 0.2
META = "capture.json"
_ID = re.compile(r"^\d{8}T\d{6}Z-\d{1,10}-[0-9a-f]{6}$")
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_PROFILING_METRICS = {"mrc_gpu_sm_instructions_executed_total", "mrc_gpu_dram_read_bytes_total"}
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


# -- the token ---------------------------------------------------------------------------------
class Token:
    """The shared webhook token, from the environment or a file re-read when it changes (a
    rotated Kubernetes Secret). An unreadable file denies every request until fixed."""

    def __init__(self, value: str | None = None, path: str | None = None) -> None:
        if (value is None) == (path is None):
            raise ValueError("give the token or its file")
        self._value = value
        self._path = path
        self._stamp: tuple[float, int] | None = None
        self._lock = threading.Lock()
        if path is not None:
            self._value = read_token_file(path)  # ConfigError at start-up: exit 2
            self._stamp = self._stat()

    def _stat(self) -> tuple[float, int] | None:
        assert self._path is not None
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_mtime, st.st_ino)

    def current(self) -> str | None:
        if self._path is None:
            return self._value
        with self._lock:
            stamp = self._stat()
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._value = read_token_file(self._path)
                    log.info("webhook token file %s re-read", self._path)
                except ConfigError as exc:
                    log.warning("%s; every request is refused until it is fixed", exc)
                    self._value = None
            return self._value

    def check(self, authorization: str | None) -> bool:
        """``Authorization: Bearer <token>``, compared in constant time."""
        expected = self.current()
        if expected is None or not authorization:
            return False
        scheme, _, given = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode(), expected.encode())


# -- the webhook payload -----------------------------------------------------------------------
class WebhookError(ValueError):
    """The body is not an Alertmanager webhook payload (version 4)."""


@dataclass(frozen=True)
class Alert:
    status: str
    labels: dict[str, str]

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")


def _str_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise WebhookError(f"{where} must be an object of strings")
    return value


def parse_webhook(body: bytes) -> list[Alert]:
    """Validate an Alertmanager webhook body (version 4) and return its alerts."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WebhookError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise WebhookError("the payload must be a JSON object")
    if data.get("version") != "4":
        raise WebhookError(f"unsupported payload version {data.get('version')!r} (want \"4\")")
    if data.get("status") not in ("firing", "resolved"):
        raise WebhookError("status must be 'firing' or 'resolved'")
    for key in ("receiver", "groupKey", "externalURL"):
        if key in data and not isinstance(data[key], str):
            raise WebhookError(f"{key} must be a string")
    for key in ("groupLabels", "commonLabels", "commonAnnotations"):
        if key in data:
            _str_map(data[key], key)
    alerts = data.get("alerts")
    if not isinstance(alerts, list) or len(alerts) > MAX_ALERTS:
        raise WebhookError(f"alerts must be a list of at most {MAX_ALERTS}")
    out = []
    for i, a in enumerate(alerts):
        if not isinstance(a, dict):
            raise WebhookError(f"alerts[{i}] must be an object")
        if a.get("status") not in ("firing", "resolved"):
            raise WebhookError(f"alerts[{i}].status must be 'firing' or 'resolved'")
        labels = _str_map(a.get("labels"), f"alerts[{i}].labels")
        if "annotations" in a:
            _str_map(a["annotations"], f"alerts[{i}].annotations")
        for key in ("startsAt", "endsAt", "generatorURL", "fingerprint"):
            if key in a and not isinstance(a[key], str):
                raise WebhookError(f"alerts[{i}].{key} must be a string")
        out.append(Alert(a["status"], labels))
    return out


# -- the store ---------------------------------------------------------------------------------
class CaptureStore:
    """The captures directory: one sub-directory per capture, named by its id, holding
    ``capture.json`` (the metadata) and the diagnosis files. Only directories whose names are
    capture ids and that hold a ``capture.json`` are ever listed or deleted."""

    def __init__(self, root: str, max_count: int, max_bytes: int, retention_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.retention_s = retention_s
        self._clock = clock
        self._lock = threading.RLock()
        os.makedirs(root, mode=0o700, exist_ok=True)

    def _dir(self, cid: str) -> str | None:
        if not _ID.match(cid):
            return None
        path = os.path.join(self.root, cid)
        return path if os.path.isfile(os.path.join(path, META)) else None

    def create(self, alert: str, pid: int) -> str:
        now = self._clock()
        cid = (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + f"-{pid}-"
               + secrets.token_hex(3))
        with self._lock:
            os.mkdir(os.path.join(self.root, cid), 0o700)
            self._write(cid, {"id": cid, "alert": alert, "pid": pid, "started": now,
                              "started_at": _iso(now), "status": "running", "verdict": None})
        return cid

    def _write(self, cid: str, meta: dict[str, Any]) -> None:
        path = os.path.join(self.root, cid, META)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        os.replace(tmp, path)

    def meta(self, cid: str) -> dict[str, Any] | None:
        path = self._dir(cid)
        if path is None:
            return None
        try:
            with open(os.path.join(path, META), encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict):
            return None
        meta["files"] = self._files(path)
        meta["bytes"] = _size(path)
        return meta

    def update(self, cid: str, **fields: Any) -> None:
        with self._lock:
            meta = self.meta(cid)
            if meta is None:
                return  # deleted meanwhile
            meta.pop("files", None)
            meta.pop("bytes", None)
            meta.update(fields)
            self._write(cid, meta)

    @staticmethod
    def _files(path: str) -> list[str]:
        names = []
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False) and _FILE.match(entry.name) and (
                    entry.name != META):
                names.append(entry.name)
        order = list(FILES.values())
        return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))

    def ids(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return [n for n in names if self._dir(n) is not None]

    def entries(self) -> list[dict[str, Any]]:
        """Every capture's metadata, newest first."""
        metas = [m for m in (self.meta(c) for c in self.ids()) if m is not None]
        return sorted(metas, key=lambda m: (m.get("started", 0), m["id"]), reverse=True)

    def file_path(self, cid: str, name: str) -> str | None:
        """The path of one file of one capture, or None: no path outside that directory, no
        link, nothing but a plain file with a plain name."""
        path = self._dir(cid)
        if path is None or not _FILE.match(name) or name.endswith(".tmp"):
            return None
        full = os.path.join(path, name)
        try:
            st = os.lstat(full)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        real = os.path.realpath(full)
        if os.path.dirname(real) != os.path.realpath(path):
            return None
        return full

    def usage(self) -> tuple[int, int]:
        ids = self.ids()
        return len(ids), sum(_size(os.path.join(self.root, c)) for c in ids)

    def prune(self, keep: Sequence[str] = (), room_for: int = 0) -> list[str]:
        """Delete captures past retention, then the oldest until at most ``max_count -
        room_for`` remain and their bytes fit ``max_bytes``. ``keep`` (the running capture) is
        never deleted. Returns the ids deleted."""
        deleted = []
        with self._lock:
            metas = sorted(self.entries(), key=lambda m: (m.get("started", 0), m["id"]))
            now = self._clock()
            alive = []
            for m in metas:
                if m["id"] not in keep and now - float(m.get("started", 0)) > self.retention_s:
                    deleted.append(m["id"])
                else:
                    alive.append(m)
            total = sum(int(m["bytes"]) for m in alive)
            count = len(alive)
            for m in list(alive):
                if count <= self.max_count - room_for and total <= self.max_bytes:
                    break
                if m["id"] in keep:
                    continue
                deleted.append(m["id"])
                count -= 1
                total -= int(m["bytes"])
            for cid in deleted:
                shutil.rmtree(os.path.join(self.root, cid), ignore_errors=True)
        if deleted:
            log.info("captures deleted (retention/limits): %s", ", ".join(deleted))
        return deleted


def _size(path: str) -> int:
    total = 0
    try:
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        return total  # deleted meanwhile: what was counted stands
    return total


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


# -- running captures --------------------------------------------------------------------------
class CaptureManager:
    """Starts captures in a background thread, one at a time and at most ``max_per_hour`` per
    rolling hour, and counts what happened to every request."""

    def __init__(self, cfg: AgentConfig, store: CaptureStore, runner: Runner,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.store = store
        self.runner = runner
        self.duration = cfg.capture_duration
        self.max_per_hour = cfg.capture_max_per_hour
        self._clock = clock
        self._lock = threading.Lock()
        self._started: deque[float] = deque()
        self._running: str | None = None
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self.counts: Counter[str] = Counter()

    @property
    def running(self) -> str | None:
        return self._running

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def targets(self) -> list[int]:
        return [t.pid for t in self.runner.targets.resolve()]

    def hottest_target(self) -> int | None:
        """The target with the most user CPU in the latest snapshot (the first target when
        none has a reading yet)."""
        targets = self.targets()
        if not targets:
            return None
        cpu = {int(labels[0]): float(v) for name, labels, v in self.runner.latest().samples
               if name == "mrc_process_cpu_user_ratio" and isinstance(v, (int, float))}
        return max(targets, key=lambda p: cpu.get(p, -1.0))

    def request(self, alert: str, pid: int) -> tuple[str, str]:
        """("accepted", capture id), ("rate-limited", why) or ("error", why) when the
        captures directory cannot take it."""
        with self._lock:
            now = self._clock()
            while self._started and now - self._started[0] >= 3600:
                self._started.popleft()
            if self._running is not None:
                self.counts["rate_limited"] += 1
                return ("rate-limited", f"capture {self._running} is still running")
            if len(self._started) >= self.max_per_hour:
                self.counts["rate_limited"] += 1
                return ("rate-limited", f"{len(self._started)} captures started in the last "
                                        f"hour (limit {self.max_per_hour})")
            try:
                self.store.prune(room_for=1)
                cid = self.store.create(alert, pid)
            except OSError as exc:
                self.counts["failed"] += 1
                log.warning("cannot start a capture in %s: %s", self.store.root, exc)
                return ("error", f"cannot write to the captures directory: "
                                 f"{exc.strerror or exc}")
            self._started.append(now)
            self._running = cid
            self.counts["accepted"] += 1
            self._thread = threading.Thread(target=self._run, args=(cid, alert, pid),
                                            name="mrc-agent-capture", daemon=True)
            self._thread.start()
        log.info("capture %s started for %s on pid %d (%.3g s)", cid, alert, pid, self.duration)
        return ("accepted", cid)

    def _collectors(self) -> tuple[list[str], list[Collector]]:
        """The agent's collectors plus process and derived; the profiling counters are read
        from the agent's own sampler when it runs them (one CUPTI session per process)."""
        names = [n for n in COLLECTORS if n != "profiling"
                 and (n in ("process", "derived") or self.cfg.collectors.get(n))]
        extra: list[Collector] = []
        if self.cfg.collectors.get("profiling"):
            extra.append(Borrowed("profiling", self.runner.latest, _PROFILING_METRICS))
        return names, extra

    def _run(self, cid: str, alert: str, pid: int) -> None:
        out = os.path.join(self.store.root, cid)
        names, extra = self._collectors()
        try:
            result = diagnose(self.cfg, pid, out, self.duration, CAPTURE_INTERVAL,
                              collectors=names, extra=extra, cancel=self._cancel)
            self.store.update(cid, status="completed", verdict=result.verdict,
                              summary=result.report["summary"], finished_at=_iso(time.time()))
            self.count("completed")
            log.info("capture %s: %s", cid, result.verdict)
        except (PySpyError, ConfigError, OSError) as exc:
            self.store.update(cid, status="failed", error=str(exc), finished_at=_iso(time.time()))
            self.count("failed")
            log.warning("capture %s failed: %s", cid, exc)
        except Exception as exc:  # a capture's bug must not take the agent down
            self.store.update(cid, status="failed", error=f"{type(exc).__name__}: {exc}",
                              finished_at=_iso(time.time()))
            self.count("failed")
            log.exception("capture %s failed", cid)
        finally:
            with self._lock:
                self._running = None
                self.store.prune()

    def prune(self) -> None:
        """Apply retention and limits now, sparing the running capture."""
        with self._lock:
            self.store.prune(keep=[self._running] if self._running else [])

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the running capture, if any, to finish."""
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self, timeout: float = 20.0) -> None:
        """Cut a running capture short (its report covers the part sampled) and wait."""
        self._cancel.set()
        self.wait(timeout)


# -- HTTP --------------------------------------------------------------------------------------
def _json(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(status, (json.dumps(obj, indent=1) + "\n").encode(), "application/json",
                    {"Cache-Control": "no-store", **(headers or {})})


class CaptureAPI:
    """The webhook and captures endpoints (an :class:`exporters.exposition.http.Routes`). With
    ``manager`` None the feature is off and every one of its paths is 404."""

    max_body_bytes = MAX_BODY_BYTES

    def __init__(self, manager: CaptureManager | None, token: Token | None,
                 hostname: str | None = None) -> None:
        self.manager = manager
        self.token = token
        #: PIDs are per pod (shareProcessNamespace): an alert about pid 7 of another pod must
        #: not capture our pid 7. A pod's hostname is its name unless spec.hostname is set.
        self.hostname = hostname or socket.gethostname()

    def handle(self, request: Request) -> Response | None:
        path = request.path
        if path != "/hooks/alertmanager" and path != "/captures" and not path.startswith(
                "/captures/"):
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
        if request.method not in ("GET", "HEAD"):
            return _json(405, {"error": "use GET"}, {"Allow": "GET, HEAD"})
        return self._captures(path)

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
            elif not raw.isdigit() or int(raw) not in watched:
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


def build_server(cfg: AgentConfig, runner: Runner, api: CaptureAPI) -> ExpositionServer:
    """The agent's exposition server with the capture endpoints."""
    from agent.core.wiring import build_registry

    host, port = cfg.host_port
    return ExpositionServer(build_registry(runner), host, port, runner.version,
                            runner.ready.is_set, routes=api)
