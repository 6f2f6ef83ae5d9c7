"""The middleware as vLLM loads it: by import path, with no arguments, in a server of several
worker processes that serves prometheus-client's multiprocess collector on ``/metrics`` — the
meter's families must count every worker's requests there, beside the server's own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

from tests.conftest import REPO, parse_metrics, series
from tests.openai_support import SMALL_PNG, chat
from tests.support import free_port

#: A server as vLLM builds one: the middleware taken from ``--middleware``'s value with vLLM's
#: own loading code, ``/metrics`` rendering a fresh multiprocess registry per scrape.
APP = textwrap.dedent('''
    import importlib, inspect
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from starlette.responses import Response
    from tests.openai_support import FakeEngine

    app = FakeEngine().app()
    own = Counter("engine_requests", "the server's own metric")

    async def metrics(request):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return Response(generate_latest(registry), media_type="text/plain")

    app.add_route("/metrics", metrics)
    for middleware in ["mrc_agent.exporters.instrumentation.MRCMeterMiddleware"]:
        module_path, object_name = middleware.rsplit(".", 1)
        imported = getattr(importlib.import_module(module_path), object_name)
        assert inspect.isclass(imported)
        app.add_middleware(imported)
''')


def test_the_middleware_by_import_path_counts_every_worker(tmp_path: Path) -> None:
    (tmp_path / "prom").mkdir()
    (tmp_path / "vllm_like.py").write_text(APP)
    port = free_port()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"),
           "PYTHONPATH": f"{tmp_path}:{REPO}:{REPO / '.ci' / 'namespace'}",
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "vllm_like:app", "--host",
                             "127.0.0.1", "--port", str(port), "--workers", "2",
                             "--log-level", "warning"], env=env, cwd=tmp_path,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                httpx.get(url + "/metrics", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        n = 24  # new connections each: the kernel spreads them over both workers
        for i in range(n):
            r = httpx.post(url + "/v1/chat/completions", timeout=30,
                           json=chat("q" * 60, SMALL_PNG, stream=bool(i % 2)))
            assert r.status_code == 200
        pids = {p.name.split("_")[-1] for p in (tmp_path / "prom").glob("*.db")}
        deadline = time.monotonic() + 10
        while True:
            values = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
            if sum(series(values, "mrc_requests_total")) == n:
                break
            assert time.monotonic() < deadline, values
            time.sleep(0.1)
        assert series(values, "mrc_request_duration_seconds_count", prompt_length="50-100",
                      resolution="<1MP") == [float(n)]
        assert sum(series(values, "mrc_time_to_first_token_seconds_count")) == n // 2
        assert series(values, "mrc_requests_in_flight") == [0.0]
        assert len(pids) >= 2, pids  # two workers, each with files of its own
    finally:
        proc.terminate()
        proc.wait(30)
