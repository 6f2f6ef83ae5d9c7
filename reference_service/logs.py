r"""One structured log line per request.

Plain form (grep-friendly, the design's format)::

    MRC_SUCCESS|latency=0.412|input_len=57|output_len=16|request_id=…|cached=false|prompt=…
    MRC_ERROR|latency=0.003|status=415|code=not_an_image|request_id=…

With ``--json-logs`` the same fields are one JSON object per line. The prompt appears only as its
readable prefix (32 UTF-8 bytes cut at a character boundary), never in full.

No field a client chose reaches any log line raw: :func:`escape` writes control and
line-breaking characters as visible ``\uXXXX``. The request lines escape every field; the other
modules escape what they log of a request (its path, a redirect's URL); and
:class:`EscapeArgs`, on the service's log handlers, escapes the string arguments of every record
besides, so a line added later cannot forget.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

log = logging.getLogger("mrc_agent.reference_service.requests")

#: Characters that must never reach a log line raw: C0/C1 controls (NUL, ESC for terminal
#: escape sequences, U+0085 NEL), line and paragraph separators, bidi overrides and
#: zero-width marks (text that reads differently than it is), and lone surrogates (which a
#: log stream cannot encode). They are written as ``\uXXXX``.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069"
                     "\ufeff\ud800-\udfff]")


def escape(text: str) -> str:
    r"""``text`` with every unsafe character as a visible ``\uXXXX`` escape."""
    return _UNSAFE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


class EscapeArgs(logging.Filter):
    """Escapes the string arguments of every record it sees (idempotent: an escaped string has
    nothing left to escape). On a handler, it covers every logger that writes there."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(escape(a) if isinstance(a, str) else a for a in record.args)
        return True


def _plain(value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    # Keep the line parseable: no field separators, newlines or control characters in values.
    return escape(text.replace("|", "/"))


def request_line(ok: bool, json_logs: bool, **fields: Any) -> str:
    if json_logs:
        # JSON escapes the C0 controls itself; the rest become \uXXXX escapes, which are
        # valid JSON for the same characters.
        return escape(json.dumps({"event": "MRC_SUCCESS" if ok else "MRC_ERROR", **fields},
                                 ensure_ascii=False, sort_keys=False))
    head = "MRC_SUCCESS" if ok else "MRC_ERROR"
    return "|".join([head, *(f"{k}={_plain(v)}" for k, v in fields.items())])


def log_request(ok: bool, json_logs: bool, **fields: Any) -> None:
    line = request_line(ok, json_logs, **fields)
    if ok:
        log.info(line)
    else:
        log.warning(line)
