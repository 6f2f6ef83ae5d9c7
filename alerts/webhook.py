"""A webhook receiver on loopback that records Alertmanager's notifications and when each
arrived: what the end-to-end tests and ``benchmarks/bench_page.py`` point the generated
Alertmanager configuration (:mod:`mrc_agent.alerts.alertmanager`) at, to see a page arrive.

It lives in the project, not under ``tests/``, because a benchmark runs as a script that imports
the installed project only (docs/testing.md, beside the shared helpers)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class WebhookReceiver:
    """Records every notification POSTed to :attr:`url`, with its arrival (Unix time), until
    :meth:`stop`. Serves on a thread of its own from construction."""

    def __init__(self, path: str = "/hook") -> None:
        self.received: list[tuple[float, dict[str, Any]]] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length", "0"))
                # Stamped on arrival, before parsing: the moment a page reaches the on-call.
                arrived = time.time()
                received.append((arrived, json.loads(self.rfile.read(length))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass  # a request line per notification would bury the test's own output

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def arrivals(self, name: str, status: str = "firing") -> list[tuple[float, dict[str, Any]]]:
        """(arrival, alert) for each alert ``name`` in ``status`` notified so far, oldest
        first."""
        return [(at, a) for at, n in self.received for a in n.get("alerts", [])
                if a["labels"].get("alertname") == name and a["status"] == status]

    def alerts(self, name: str, status: str = "firing") -> list[dict[str, Any]]:
        """The alerts ``name`` in ``status`` notified so far, oldest first."""
        return [a for _, a in self.arrivals(name, status)]

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.server.shutdown()
        self.server.server_close()
