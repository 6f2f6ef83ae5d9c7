"""``mrc-agent diagnose --agent URL``: the diagnosis asked of the running agent beside the
target instead of run here. The agent runs it as an on-alert capture (``POST /captures``,
behind its webhook token), on its own continuous stack samples where its stacks collector has
them, so no second sampler attaches to the target; this side waits for it and copies its files
into the output directory.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from mrc_agent.agent.core.config import ConfigError

#: Seconds past the window the agent may take to write a capture (py-spy's own flush included).
MARGIN_S = 60.0


class AgentError(Exception):
    """The agent could not be asked, or its capture failed: the message says why (exit 1)."""


def read_token(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read(4096).strip()
    except OSError as exc:
        raise ConfigError(f"--agent-token-file {path!r}: {exc.strerror or exc}") from exc
    if not token:
        raise ConfigError(f"--agent-token-file {path!r} is empty")
    return token


def diagnose_via_agent(url: str, token: str, pid: int, duration: float, out: str,
                       poll_s: float = 0.5) -> dict[str, Any]:
    """Ask the agent at ``url`` for a capture of ``pid`` over ``duration`` seconds, wait for
    it and copy its files into ``out``; returns its ``report.json``. Raises ConfigError for
    what the caller got wrong (the agent says 400/401/404) and AgentError for the rest."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"}
    base = url.rstrip("/")
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=10) as client:
            r = client.post("/captures", json={"pid": pid, "duration": duration})
            body = _json(r)
            if r.status_code in (400, 401, 404):
                hint = (" (is the agent's webhook enabled, --webhook-token-file?)"
                        if r.status_code == 404 and "enabled" in str(body.get("error")) else "")
                raise ConfigError(f"the agent at {base} answered {r.status_code}: "
                                  f"{body.get('error', r.text[:200])}{hint}")
            if r.status_code != 202:
                raise AgentError(f"the agent at {base} answered {r.status_code}: "
                                 f"{body.get('reason') or body.get('error') or r.text[:200]}")
            cid = str(body["capture"])
            deadline = time.monotonic() + duration + MARGIN_S
            while True:
                meta = _json(client.get(f"/captures/{cid}"))
                if meta.get("status") != "running":
                    break
                if time.monotonic() > deadline:
                    raise AgentError(f"capture {cid} still running after "
                                     f"{duration + MARGIN_S:g} s")
                time.sleep(poll_s)
            if meta.get("status") != "completed":
                raise AgentError(f"capture {cid} {meta.get('status')}: {meta.get('error')}")
            os.makedirs(out, exist_ok=True)
            for name in meta.get("files") or []:
                got = client.get(f"/captures/{cid}/{name}")
                if got.status_code == 200 and os.path.basename(name) == name:
                    with open(os.path.join(out, name), "wb") as f:
                        f.write(got.content)
    except httpx.HTTPError as exc:
        raise AgentError(f"cannot reach the agent at {base}: {exc}") from exc
    try:
        with open(os.path.join(out, "report.json"), encoding="utf-8") as f:
            report: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as exc:
        raise AgentError(f"capture {cid} has no readable report.json: {exc}") from exc
    return report


def _json(r: Any) -> dict[str, Any]:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
