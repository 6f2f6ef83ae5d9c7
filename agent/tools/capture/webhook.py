"""The webhook's inputs: the shared bearer :class:`Token` (from the environment or a file
re-read when it changes), and the Alertmanager payload (version 4) parsed into :class:`Alert`s or
refused with a :class:`WebhookError`.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from mrc_agent.agent.core.config import ConfigError, read_token_file

log = logging.getLogger(__name__)


#: Alertmanager sends every alert of a group in one payload; 1 MiB holds hundreds (set
#: ``max_alerts`` on the webhook receiver to stay well inside it).
MAX_BODY_BYTES = 1 << 20
MAX_ALERTS = 1000


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
    except RecursionError as exc:
        raise WebhookError("the payload is nested too deeply") from exc
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

