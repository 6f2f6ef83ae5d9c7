"""One structured log line per request.

Plain form (grep-friendly, the design's format)::

    MRC_SUCCESS|latency=0.412|input_len=57|output_len=16|request_id=…|cached=false|prompt=…
    MRC_ERROR|latency=0.003|status=415|code=not_an_image|request_id=…

With ``--json-logs`` the same fields are one JSON object per line. The prompt appears only as its
readable prefix (32 UTF-8 bytes cut at a character boundary), never in full.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("reference_service.requests")


def _plain(value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    # Keep the line parseable: no field separators or newlines inside values.
    return text.replace("|", "/").replace("\n", " ").replace("\r", " ")


def request_line(ok: bool, json_logs: bool, **fields: Any) -> str:
    if json_logs:
        return json.dumps({"event": "MRC_SUCCESS" if ok else "MRC_ERROR", **fields},
                          ensure_ascii=False, sort_keys=False)
    head = "MRC_SUCCESS" if ok else "MRC_ERROR"
    return "|".join([head, *(f"{k}={_plain(v)}" for k, v in fields.items())])


def log_request(ok: bool, json_logs: bool, **fields: Any) -> None:
    line = request_line(ok, json_logs, **fields)
    if ok:
        log.info(line)
    else:
        log.warning(line)
