"""The MRC chain for one request: fetch → decode → preprocess → OCR → VLM answer, measured.

Each step is timed into ``mrc_stage_duration_seconds``; an intermediate step that gives nothing
usable (no image behind the URL, no text found by OCR) is a chain break; the answer cache is
consulted once the image is known, with a key over the whole prompt (never a prefix). A request
is admitted to the chain before its image is decoded, or refused with a fast 429 (a bounded
number are in the chain, not a growing backlog); it decodes and reads text on pools of their
own, and holds a model slot only while the model runs. OCR, which a page of dense text keeps
busy for its whole timeout, so never delays another request's model work; a request that finds
every OCR thread taken takes over the thread of a call past :data:`OCR_PREEMPT_AFTER_S`, waits
:data:`OCR_WAIT_S` at most, and otherwise answers without the text.

An answer made with a degraded step (OCR failed, timed out or found no thread free) is not
cached: it would be served for the cache's whole lifetime to requests made when the step works.
Every request ends in exactly one structured log line.

A streamed answer (``MRCRequest.on_text``, the OpenAI API's ``"stream": true``) runs the same
chain; its text is handed on piece by piece as the model makes it, and its time to first token is
the first piece of text (what its client first reads), not the first token (which may be
whitespace, or half a character). A cached answer comes as one piece, and, as on ``/mrc``, with no
time to first token: the model made none. When ``MRCRequest.cancel`` is set (the client left),
the request is not given a model slot, or its generation stops at the next token, and it ends as
499 ``client_closed``, uncached.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PIL import Image

from mrc_agent.reference_service.cache import make_key
from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.fetch import fetch_image
from mrc_agent.reference_service.limiter import StepBusy
from mrc_agent.reference_service.logs import log_request
from mrc_agent.reference_service.ocr import OCRError
from mrc_agent.reference_service.preprocess import preprocess_async, probe_async
from mrc_agent.reference_service.state import ServiceState

#: OCR text is added to the prompt as context for the model; long page dumps are cut so the
#: user's question is never truncated away by the OCR text.
MAX_OCR_CHARS = 400
#: Long side of the image handed to tesseract: text a phone photo shows stays legible, and the
#: draft-mode decode can still skip most of a 12 MP JPEG.
OCR_MAX_SIDE = 1600
#: The longest a request waits for a free OCR thread before it answers without the image's
#: text: about one ordinary page's OCR, so a burst of real requests still gets its text, while
#: inputs that keep tesseract busy for its whole 10 s cost other requests this much at most.
OCR_WAIT_S = 2.0
#: A request waiting for an OCR thread takes over the thread of a call that has run this long:
#: several times a photo label's OCR (0.1-0.3 s on one core), a fraction of the 10 s timeout
#: that a page of dense text runs into. The call taken over answers without its text.
OCR_PREEMPT_AFTER_S = 1.0
#: OCR threads per model slot. A thread mostly waits for its tesseract child, and a call that
#: runs long is demoted to nice 19 (:mod:`~mrc_agent.reference_service.ocr`), so two long calls
#: per slot leave a quick one its thread and its CPU.
OCR_THREADS_PER_SLOT = 2


@dataclass
class MRCRequest:
    request_id: str
    prompt: str
    max_new_tokens: int
    image: bytes | None = None
    image_url: str | None = None
    #: Streams the answer: called on the event loop with each new piece of its text (a cached
    #: answer in one piece). None: the answer comes whole.
    on_text: Callable[[str], None] | None = None
    #: Set when nobody waits for the answer any more (a stream's client left).
    cancel: threading.Event | None = None


def _chain_prompt(prompt: str, ocr_text: str) -> str:
    if not ocr_text:
        return prompt
    return f"{prompt}\nText found in the image: {ocr_text[:MAX_OCR_CHARS]}"


def mark_counted(exc: BaseException) -> None:
    """Note on ``exc`` that its request is already in ``mrc_requests_total`` (the error
    handlers count only the requests refused before the pipeline)."""
    with contextlib.suppress(AttributeError):  # an exception type without a __dict__
        exc.mrc_counted = True  # type: ignore[attr-defined]


def counted(exc: BaseException) -> bool:
    return bool(getattr(exc, "mrc_counted", False))


async def answer(state: ServiceState, req: MRCRequest) -> dict[str, Any]:
    """Run the chain; returns the response body or raises ServiceError (logged either way)."""
    settings, metrics = state.settings, state.metrics
    t0 = time.perf_counter()
    fields: dict[str, Any] = {}
    try:
        with metrics.request(prompt_chars=len(req.prompt)) as r:
            try:
                body = await _run(state, req, r, fields)
            except ServiceError as exc:
                r.set_status(exc.status)
                raise
            except BaseException as exc:
                mark_counted(exc)
                raise
    except ServiceError as exc:
        mark_counted(exc)
        log_request(False, settings.json_logs, latency=f"{time.perf_counter() - t0:.3f}",
                    status=exc.status, code=exc.code, request_id=req.request_id, **fields)
        raise
    except Exception as exc:
        log_request(False, settings.json_logs, latency=f"{time.perf_counter() - t0:.3f}",
                    status=500, code="internal", request_id=req.request_id,
                    error=type(exc).__name__, **fields)
        raise
    latency = time.perf_counter() - t0
    body["latency_ms"] = round(latency * 1000, 1)
    log_request(True, settings.json_logs, latency=f"{latency:.3f}",
                input_len=body["input_tokens"], output_len=body["output_tokens"],
                request_id=req.request_id, cached=body["cached"], **fields)
    return body


async def _run(state: ServiceState, req: MRCRequest, r: Any,
               fields: dict[str, Any]) -> dict[str, Any]:
    settings, metrics = state.settings, state.metrics
    vlm = state.vlm
    if not state.ready or vlm is None:
        raise ServiceError.of("model_not_ready", f"the model is {state.loading}")
    data = req.image
    if req.image_url is not None:
        with r.stage("fetch"):
            try:
                data = await fetch_image(req.image_url, settings)
            except ServiceError as exc:
                if exc.status >= 500:  # the step failed, not the client's URL
                    metrics.chain_break("fetch")
                raise
    assert data is not None
    fmt, width, height = await probe_async(state.header_pool, data, settings)
    r.set_image(width, height)
    key = make_key(data, req.prompt, vlm.info.model_id, vlm.info.revision,
                   {"max_new_tokens": req.max_new_tokens, "ocr": state.ocr_on})
    fields.update(prompt=key.prefix, image=f"{fmt}:{width}x{height}")
    hit = state.cache.get(key)
    metrics.cache_lookup(hit is not None)
    if hit is not None:
        with r.stage("postprocess"):
            if req.on_text is not None and hit["answer"]:
                req.on_text(hit["answer"])
            return {**hit, "cached": True, "ttft_ms": 0.0, "request_id": req.request_id}

    async with state.admission.admit():
        # From its first kernel to its last tensor the request occupies the model's device, so
        # a concurrent request's peak-memory reading counts it as sharing the device.
        with vlm.device_users.occupy() as device_user:
            pre = await preprocess_async(
                state.decode_pool, data, vlm.image_size, vlm.image_mean, vlm.image_std,
                vlm.device, OCR_MAX_SIDE if state.ocr_on else None, settings)
            r.observe_stage("decode", pre.decode_s)
            r.observe_stage("preprocess", pre.preprocess_s)
            pixel_values, ocr_image = pre.pixel_values, pre.ocr_image
            del pre
            ocr_text, degraded = "", False
            if state.ocr is not None and ocr_image is not None:
                ocr_text, degraded = await _read_text(state, ocr_image, r, fields)
            del ocr_image
            _check_client(req)
            async with state.admission.slot(waiting=r.queued()):
                _check_client(req)
                loop = asyncio.get_running_loop()
                result = await loop.run_in_executor(state.model_pool, functools.partial(
                    vlm.generate, pixel_values, _chain_prompt(req.prompt, ocr_text),
                    req.max_new_tokens, device_user=device_user,
                    **_streaming(req, r, loop)))
            del pixel_values  # the request's last tensor on the device
        r.tokens(result.output_tokens, result.input_tokens)
        r.observe_stage("prefill", result.prefill_s)
        r.observe_stage("generate", result.generate_s)
        if result.peak_gpu_memory_bytes is not None:
            r.peak_gpu_memory(result.peak_gpu_memory_bytes)
        if result.peak_gpu_memory_shared_with is not None:
            # The histogram cannot say whether a peak was the request's own: its log line can.
            fields["gpu_peak_shared_with"] = result.peak_gpu_memory_shared_with

        if result.finish_reason == "abort":
            raise _client_gone()

    with r.stage("postprocess"):
        body = {
            "answer": result.text.strip(),
            "input_tokens": result.input_tokens,
            "output_tokens": result.output_tokens,
            "truncated": result.truncated,
            "ocr_text": ocr_text,
            "meaningful": vlm.meaningful,
            "finish_reason": result.finish_reason,
        }
        if not degraded:
            state.cache.put(key, body,
                            len(body["answer"].encode()) + len(ocr_text.encode()) + 128)
    return {**body, "cached": False, "ttft_ms": round(result.ttft_s * 1000, 1),
            "request_id": req.request_id}


def _client_gone() -> ServiceError:
    return ServiceError.of("client_closed", "the client left before its answer was complete")


def _check_client(req: MRCRequest) -> None:
    if req.cancel is not None and req.cancel.is_set():
        raise _client_gone()


def _streaming(req: MRCRequest, r: Any, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    """The model's keyword arguments for ``req``: a whole answer's TTFT is its first token; a
    streamed one's its first piece of text, handed to the event loop as it is made."""
    if req.on_text is None:
        return {"on_first_token": r.first_token}
    sink = req.on_text

    def on_text(piece: str) -> None:  # on the model's thread
        r.first_token()
        loop.call_soon_threadsafe(sink, piece)

    return {"on_text": on_text, "stop": req.cancel}


async def _read_text(state: ServiceState, image: Image.Image, r: Any,
                     fields: dict[str, Any]) -> tuple[str, bool]:
    """The OCR step on its own threads, outside the model slot: the text found, and whether the
    step was degraded (failed, timed out, taken over by another request, or no thread free
    within :data:`OCR_WAIT_S`)."""
    assert state.ocr is not None
    text, degraded = "", False
    with r.stage("ocr"):
        try:
            text = await state.ocr_step.run(state.ocr.read, image)
        except OCRError as exc:
            fields["ocr_error"], degraded = exc.reason, True
        except StepBusy:
            fields["ocr_error"], degraded = "busy", True
    if not text:
        state.metrics.chain_break("ocr")
    return text, degraded
