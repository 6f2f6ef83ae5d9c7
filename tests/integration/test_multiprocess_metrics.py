"""MRC metrics under several worker processes: a real ``uvicorn --workers 2`` on loopback with
``PROMETHEUS_MULTIPROC_DIR`` set, driven with httpx; every scrape, whichever worker answers it,
must show the whole service."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mrc_agent.exporters.instrumentation import prepare_multiproc_dir
from tests.conftest import REPO, parse_metrics, series
from tests.support import free_port

N = 40

APP = textwrap.dedent('''
    """Tiny MRC-shaped service for the multiprocess metrics test."""
    import os
    import time
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request

    from mrc_agent.exporters.instrumentation import MRCMetrics, mark_process_dead, metrics_endpoint

    metrics = MRCMetrics()


    @asynccontextmanager
    async def lifespan(app):
        metrics.set_model_info(model_id="mp-test", revision="r1", dtype="float32",
                               device="cpu", attention_backend="math")
        yield
        mark_process_dead()  # this worker's live gauges stop counting


    app = FastAPI(lifespan=lifespan)
    app.add_route("/metrics", metrics_endpoint())


    @app.middleware("http")
    async def worker_pid(request: Request, call_next):
        response = await call_next(request)
        response.headers["x-worker-pid"] = str(os.getpid())
        return response


    @app.post("/mrc")
    async def mrc(body: dict):
        with metrics.request(prompt_chars=len(body["prompt"])) as r:
            with r.stage("decode"):
                # Blocks this worker's event loop on purpose: while it sleeps, only the other
                # worker can accept, so concurrent requests are spread over both.
                time.sleep(0.02)
            r.set_image(body["width"], body["height"])
            with r.stage("generate"):
                r.first_token()
                r.tokens(4)
        return {"pid": os.getpid()}


    @app.post("/block")
    async def block(ms: int):
        time.sleep(ms / 1000)  # holds this worker so that a concurrent scrape goes to the other
        return {"pid": os.getpid()}
''')


def _client() -> httpx.Client:
    # A fresh connection per request (no keep-alive), or one worker would answer everything.
    return httpx.Client(trust_env=False, timeout=10, headers={"Connection": "close"})


def _post(url: str, **kw: object) -> httpx.Response:
    with _client() as c:
        r = c.post(url, **kw)  # type: ignore[arg-type]
    r.raise_for_status()
    return r


def _scrape(url: str) -> tuple[str, str]:
    with _client() as c:
        r = c.get(url + "/metrics")
    r.raise_for_status()
    return r.headers["x-worker-pid"], r.text


def test_two_uvicorn_workers_aggregate_into_one_exposition(tmp_path: Path) -> None:
    (tmp_path / "mp_app.py").write_text(APP)
    mpdir = tmp_path / "prom"
    mpdir.mkdir()
    (mpdir / "counter_999999.db").write_bytes(b"stale garbage from a previous run")
    prepare_multiproc_dir(mpdir)  # what a launcher does before starting the workers
    assert not list(mpdir.iterdir())

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mpdir), "PYTHONPATH": str(REPO)}
    log = (tmp_path / "uvicorn.log").open("w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "mp_app:app", "--app-dir", str(tmp_path),
         "--workers", "2", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)

    def server_log() -> str:
        log.seek(0)
        return log.read()

    try:
        # Ready when both workers have started (each writes its files at import).
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, "uvicorn exited:\n" + server_log()
            assert time.monotonic() < deadline, "uvicorn not ready:\n" + server_log()
            try:
                _scrape(url)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if len({p.name.rsplit("_", 1)[-1] for p in mpdir.glob("gauge_livemax_*.db")}) == 2:
                break
            time.sleep(0.2)

        shapes = [("q" * 10, 640, 480), ("q" * 70, 1920, 1080), ("q" * 300, 4000, 3000)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(
                lambda i: _post(url + "/mrc", json=dict(zip(("prompt", "width", "height"),
                                                            shapes[i % 3], strict=True))),
                range(N)))
        served_by = {a.json()["pid"] for a in answers}
        assert len(served_by) == 2, f"requests were not spread over both workers: {served_by}"

        # Scrape while one worker is held busy, so the other answers; repeat until both have.
        scraped_by: set[str] = set()
        bodies = []
        with ThreadPoolExecutor(1) as pool:
            for _ in range(40):
                held = pool.submit(_post, url + "/block", params={"ms": 300})
                time.sleep(0.1)
                pid, body = _scrape(url)
                assert str(held.result().json()["pid"]) != pid
                scraped_by.add(pid)
                bodies.append(body)
                if len(scraped_by) == 2:
                    break
        assert len(scraped_by) == 2, "every scrape was answered by the same worker"

        for body in bodies:
            m = parse_metrics(body)
            assert series(m, "mrc_requests_total", outcome="ok") == [N]
            assert sum(series(m, "mrc_requests_total")) == N
            assert sum(series(m, "mrc_request_duration_seconds_count")) == N
            assert sum(series(m, "mrc_time_to_first_token_seconds_count")) == N
            assert series(m, "mrc_request_duration_seconds_count", prompt_length="100+",
                          resolution=">4MP") == [len(range(2, N, 3))]
            assert len(series(m, "mrc_request_duration_seconds_count")) == 9  # all bound
            assert series(m, "mrc_stage_duration_seconds_count", stage="decode") == [N]
            assert series(m, "mrc_requests_in_flight") == [0]  # livesum, pid dropped
            assert series(m, "mrc_requests_queued") == [0]
            assert series(m, "mrc_model_info", model_id="mp-test") == [1]  # livemax: one series

        promtool = shutil.which("promtool")
        assert promtool, "promtool not on PATH: install Debian's prometheus package"
        res = subprocess.run([promtool, "check", "metrics"], input=bodies[-1].encode(),
                             capture_output=True, timeout=30)
        assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), (
            res.stdout.decode() + res.stderr.decode())
    finally:
        server.terminate()
        try:
            server.wait(20)
        finally:
            server.kill()
            server.wait()
            log.close()

    # Graceful exit ran mark_process_dead in each worker: live gauges gone, counters kept.
    assert not list(mpdir.glob("gauge_live*.db")), sorted(p.name for p in mpdir.iterdir())
    assert len(list(mpdir.glob("counter_*.db"))) == 2


SCRIPT = textwrap.dedent("""
    import itertools, json, sys
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    # where the tracker looks up perf_counter
    import mrc_agent.exporters.instrumentation.metrics as mm
    from mrc_agent.exporters.instrumentation import STAGES, MRCMetrics, exposition_registry

    ticks = itertools.count()
    mm.perf_counter = lambda: next(ticks) * 0.037  # a fake clock: the same values in both runs
    m = MRCMetrics()
    m.set_model_info(model_id="a", revision="1", device="cpu")
    m.set_model_info(model_id="b", revision="2", device="cpu", attention_backend="flash")
    for i, (chars, w, h) in enumerate([(3, 640, 480), (60, 1500, 1000), (500, 4000, 3000)] * 5):
        try:
            with m.request(prompt_chars=chars) as r:
                with r.queued():
                    pass
                m.cache_lookup(hit=i % 2 == 0)
                for s in STAGES[: 1 + i % 7]:
                    with r.stage(s):
                        pass
                r.set_image(w, h)
                r.first_token()
                r.tokens(i, 2 * i + 1)
                if i % 3 == 0:
                    r.peak_gpu_memory(i * 2**30)
                if i % 5 == 4:
                    raise TimeoutError
        except TimeoutError:
            m.chain_break("ocr")
    m.observe_stage("ocr", 0.5)
    with m.queued():
        pass
    text = generate_latest(exposition_registry(m.registry)).decode()
    out = {}
    for f in text_string_to_metric_families(text):
        samples = sorted((s.name, sorted(s.labels.items()), s.value) for s in f.samples
                         if not s.name.endswith("_created"))
        out[f.name] = [f.type, f.documentation, samples]
    json.dump(out, sys.stdout)
""")


def test_single_process_and_multiprocess_expositions_are_identical(tmp_path: Path) -> None:
    """The two value stores render the same families, labels and values for the same calls,
    so dashboards and alerts do not depend on the number of workers."""
    import json

    def run(extra: dict[str, str]) -> dict[str, object]:
        env = {k: v for k, v in os.environ.items() if k.upper() != "PROMETHEUS_MULTIPROC_DIR"}
        res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                             cwd=REPO, env={**env, **extra}, timeout=60)
        assert res.returncode == 0, res.stderr
        return dict(json.loads(res.stdout))

    single = run({})
    multi = run({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert single.keys() == multi.keys()
    for name in single:
        assert single[name] == multi[name], name
    assert "mrc_model_info" in single


def test_env_var_set_after_import_is_refused(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import os
        import prometheus_client
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path)!r}
        from mrc_agent.exporters.instrumentation import MRCMetrics
        try:
            MRCMetrics()
        except RuntimeError as e:
            print("refused:", e)
    """)
    env = {k: v for k, v in os.environ.items() if k.upper() != "PROMETHEUS_MULTIPROC_DIR"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("refused:"), res.stdout


@pytest.mark.parametrize("missing", [True, False])
def test_multiprocess_dir_must_exist(tmp_path: Path, missing: bool) -> None:
    d = tmp_path / "nope" if missing else tmp_path
    code = ("from mrc_agent.exporters.instrumentation import MRCMetrics\n"
            "m = MRCMetrics()\nprint(m.multiprocess)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(d)}, timeout=60)
    if missing:
        assert res.returncode != 0 and "is not a directory" in res.stderr
    else:
        assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr
