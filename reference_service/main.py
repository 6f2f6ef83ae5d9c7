"""Wires the reference MRC service: state, routers, error handlers, the model's lifespan.

The model loads once, in the lifespan, on a worker thread — so ``/health`` answers while it
loads and ``/ready`` says 503 until it is loaded and warmed. Every error leaves as
``{"error": {"code": …, "message": …}}``, or in the OpenAI API's shape on its paths
(:func:`~mrc_agent.reference_service.errors.error_json`); 429 and 503 carry ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mrc_agent.exporters.instrumentation import MRCMetrics, mark_process_dead, metrics_endpoint
from mrc_agent.reference_service.cache import AnswerCache
from mrc_agent.reference_service.errors import ServiceError, error_json
from mrc_agent.reference_service.limiter import Admission, BoundedStep, Overloaded
from mrc_agent.reference_service.logs import escape
from mrc_agent.reference_service.middleware import BodyLimit
from mrc_agent.reference_service.ocr import OCR
from mrc_agent.reference_service.pipeline import (
    OCR_PREEMPT_AFTER_S,
    OCR_THREADS_PER_SLOT,
    OCR_WAIT_S,
    counted,
)
from mrc_agent.reference_service.preprocess import DecodePool, max_encoded_len
from mrc_agent.reference_service.routers import chat, health, mrc
from mrc_agent.reference_service.routers.chat import CHAT_PATH
from mrc_agent.reference_service.routers.mrc import MRC_PATHS
from mrc_agent.reference_service.settings import Settings
from mrc_agent.reference_service.state import ServiceState

log = logging.getLogger(__name__)

#: Loads the model: ``(settings, progress) -> VLM``. Tests may pass their own.
Loader = Callable[[Settings, Callable[[str], None]], Any]


def _default_loader(settings: Settings, progress: Callable[[str], None]) -> Any:
    from mrc_agent.reference_service.model import load_vlm

    return load_vlm(settings, progress=progress)


#: glibc's ``mallopt`` parameter number for the mmap threshold (malloc.h: M_MMAP_THRESHOLD).
_M_MMAP_THRESHOLD = -3


def return_large_frees_to_the_os(threshold: int = 4 << 20) -> bool:
    """Serve allocations of ``threshold`` bytes and more with their own mappings, so that freeing
    a decoded photo gives its memory back to the system.

    glibc raises its mmap threshold each time a mapped chunk is freed (up to 32 MB), after
    which the 16 MB blocks Pillow decodes into come from the heap and stay there: six
    7000x7000 RGBA decodes left about 1 GB resident for good. A fixed threshold stops that
    (benchmarks/bench_image_memory.py: 0-1 MB left instead). Not glibc: nothing to do, False.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def build_state(settings: Settings) -> ServiceState:
    return_large_frees_to_the_os()
    ocr: OCR | None = None
    if settings.ocr != "off":
        candidate = OCR()
        if candidate.available:
            ocr = candidate
        elif settings.ocr == "on":
            raise RuntimeError(f"--ocr on, but OCR is unavailable: {candidate.unavailable_reason}")
        else:
            log.warning("OCR step off: %s", candidate.unavailable_reason)
    metrics = MRCMetrics()
    ocr_threads = OCR_THREADS_PER_SLOT * settings.max_concurrency
    ocr_pool = ThreadPoolExecutor(ocr_threads, thread_name_prefix="mrc-ocr")
    return ServiceState(
        settings=settings,
        metrics=metrics,
        cache=AnswerCache(settings.cache_max_entries, settings.cache_max_bytes,
                          settings.cache_ttl_s),
        admission=Admission(settings.max_concurrency, settings.max_queue,
                            settings.retry_after_s),
        decode_pool=DecodePool(settings.decode_workers, on_abandoned=functools.partial(
            metrics.abandoned_threads, "decode")),
        header_pool=DecodePool(settings.preprocess_workers, name="mrc-header",
                               on_abandoned=functools.partial(metrics.abandoned_threads,
                                                              "header")),
        model_pool=ThreadPoolExecutor(settings.max_concurrency, thread_name_prefix="mrc-model"),
        ocr_pool=ocr_pool,
        ocr_step=BoundedStep(ocr_pool, ocr_threads, OCR_WAIT_S,
                             preempt_after_s=OCR_PREEMPT_AFTER_S),
        ocr=ocr,
    )


async def _load_model(state: ServiceState, loader: Loader) -> None:
    def progress(step: str) -> None:
        state.loading = step
        log.info("model: %s", step)

    try:
        vlm = await asyncio.to_thread(loader, state.settings, progress)
        progress("warming up")
        await asyncio.to_thread(vlm.warmup)
    except Exception as exc:  # reported on /health; the service stays up and says why
        state.loading, state.load_error = "failed", f"{type(exc).__name__}: {exc}"
        log.error("model failed to load: %s", state.load_error)
        return
    threads = getattr(vlm, "cpu_threads_hint", None)
    if threads:
        # For a model this small, intra-op threads only contend with each other and with the
        # preprocessing pool; the model module measured what is best and says so.
        import torch

        torch.set_num_threads(threads)
    info = vlm.info
    state.metrics.set_model_info(model_id=info.model_id, revision=info.revision,
                                 dtype=info.dtype, quantization=info.quantization,
                                 device=info.device, attention_backend=info.attention_backend)
    state.vlm = vlm
    state.loading, state.ready = "ready", True
    log.info("model ready: %s on %s (%s, quantization %s, attention %s)%s", info.model_id,
             info.device, info.dtype, info.quantization, info.attention_backend,
             "" if vlm.meaningful else " — embedded model with random weights: answers are "
             "NOT meaningful")


def create_app(settings: Settings | None = None, loader: Loader | None = None) -> FastAPI:
    settings = settings or Settings()
    state = build_state(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_load_model(state, loader or _default_loader))
        try:
            yield
        finally:
            task.cancel()
            state.model_pool.shutdown(wait=False, cancel_futures=True)
            state.ocr_pool.shutdown(wait=False, cancel_futures=True)
            state.decode_pool.shutdown()
            state.header_pool.shutdown()
            mark_process_dead()  # multiprocess mode: this worker's live gauges stop counting

    app = FastAPI(title="MRC reference service", version="0.1.0", lifespan=lifespan)
    app.state.mrc = state
    app.include_router(mrc.router)
    app.include_router(chat.router)
    app.include_router(health.router)
    app.add_route("/metrics", metrics_endpoint(state.metrics.registry), methods=["GET"],
                  include_in_schema=False)
    def count_refused(path: str, status: int, exc: BaseException | None = None) -> None:
        """Count an MRC request answered before the pipeline took it (bad JSON, a schema
        error, an oversized body, a wrong method): every request is counted once."""
        if (path in MRC_PATHS or path == CHAT_PATH) and (exc is None or not counted(exc)):
            with state.metrics.request() as r:
                r.set_status(status)

    app.add_middleware(BodyLimit, max_bytes=max_encoded_len(settings.max_image_bytes) + 65536,
                       on_refuse=count_refused)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        count_refused(request.url.path, exc.status, exc)
        headers = {}
        if isinstance(exc, Overloaded):
            headers["Retry-After"] = str(exc.retry_after_s)
        elif exc.status == 503:
            headers["Retry-After"] = "5"
        return JSONResponse(error_json(request.url.path, exc.status, exc.code, exc.message,
                                       exc.param), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        count_refused(request.url.path, 422, exc)
        return JSONResponse(error_json(request.url.path, 422, "invalid_request", str(exc)),
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        count_refused(request.url.path, exc.status_code, exc)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_json(request.url.path, exc.status_code, code,
                                       str(exc.detail)),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        count_refused(request.url.path, 500, exc)
        log.exception("unhandled error on %s", escape(request.url.path))
        # The server closes the connection after an unhandled error: say so, so that a
        # client's next request does not fail on a connection it believes kept alive.
        return JSONResponse(error_json(request.url.path, 500, "internal", "internal error"),
                            status_code=500, headers={"Connection": "close"})

    return app


def app_from_env() -> FastAPI:
    """Factory for uvicorn worker processes: settings come through the environment."""
    import os

    from mrc_agent.reference_service.settings import ENV_SETTINGS, settings_from_json

    return create_app(settings_from_json(os.environ[ENV_SETTINGS]))
