"""``POST /v1/chat/completions`` and ``GET /v1/models``: the OpenAI chat API on the service's chain.

A chat request (read by :func:`~mrc_agent.reference_service.chat.parse_chat`) becomes the same
:class:`~mrc_agent.reference_service.pipeline.MRCRequest` as ``POST /mrc`` and runs the same
:func:`~mrc_agent.reference_service.pipeline.answer`: admission and the 429 queue, the cache,
decode, OCR, the model slots, timeouts, the request metrics (families, stages, tokens, outcome)
and the log line are those of ``/mrc``. Errors are the OpenAI API's shape
(:func:`~mrc_agent.reference_service.errors.error_json`) with the service's statuses and codes.

Not streamed: one ``chat.completion`` object with ``usage``. Streamed (``"stream": true``):
server-sent events ``data: {chat.completion.chunk}`` — the role, then each piece of text as the
model makes it, then the ``finish_reason`` — a last chunk with ``usage`` and no choices when
``stream_options.include_usage`` asked for it, and ``data: [DONE]``. The status is decided
before the first byte: the response starts once the answer's first text exists (or the answer
ended), so an image the chain refuses is a 4xx with its error, never a 200 with an error event;
only a failure after the text began is an error event (``data: {"error": …}``) before
``[DONE]``. A client that leaves a stream — mid-answer, or while its request waits for a model
slot or its first text — stops its generation at the next token, or before it starts; the
request ends as 499 ``client_closed`` (the ``client_error`` outcome), its partial answer
uncached, in its one log line.

``X-MRC-Cached: true`` says the answer came from the service's answer cache (its ``usage`` then
repeats the cached answer's; the model, and the token counters, processed none).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from mrc_agent.reference_service.chat import (
    IMAGE_CODES,
    ChatRequest,
    chunk,
    completion,
    parse_chat,
    usage,
)
from mrc_agent.reference_service.errors import ServiceError, error_json
from mrc_agent.reference_service.pipeline import MRCRequest, answer
from mrc_agent.reference_service.routers.mrc import json_body
from mrc_agent.reference_service.state import ServiceState

log = logging.getLogger(__name__)
router = APIRouter()

#: The path of chat requests: each is counted once in ``mrc_requests_total``, by outcome.
CHAT_PATH = "/v1/chat/completions"
_DONE = b"data: [DONE]\n\n"
_STARTED = int(time.time())


def _state(request: Request) -> ServiceState:
    return request.app.state.mrc  # type: ignore[no-any-return]


def _served_model(state: ServiceState) -> str | None:
    return None if state.vlm is None else str(state.vlm.info.model_id)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


def _cached_header(cached: bool) -> dict[str, str]:
    return {"X-MRC-Cached": "true" if cached else "false"}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The served model (none while it loads), as the OpenAI API lists models."""
    model = _served_model(_state(request))
    data = [] if model is None else [{"id": model, "object": "model", "created": _STARTED,
                                      "owned_by": "mrc-reference-service"}]
    return {"object": "list", "data": data}


@router.post(CHAT_PATH, openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"type": "object", "required": ["messages"]}}}}})
async def chat_completions(request: Request) -> Any:
    state = _state(request)
    served = _served_model(state)
    parsed = parse_chat(json_body(await request.body()), state.settings, served)
    req = MRCRequest(request_id=uuid.uuid4().hex, prompt=parsed.prompt,
                     max_new_tokens=parsed.max_tokens, image=parsed.image,
                     image_url=parsed.image_url)
    completion_id = f"chatcmpl-{req.request_id}"
    if not parsed.stream:
        body = await _answer(state, req, parsed)
        return JSONResponse(completion(completion_id, served or "", body),
                            headers=_cached_header(bool(body["cached"])))
    return await _stream(state, req, parsed, completion_id, request.receive)


async def _answer(state: ServiceState, req: MRCRequest, parsed: ChatRequest) -> dict[str, Any]:
    """The pipeline's answer; an error about the image names the image part as its param."""
    try:
        return await answer(state, req)
    except ServiceError as exc:
        if exc.param is None and exc.code in IMAGE_CODES:
            exc.param = parsed.image_param
        raise


async def _next(pieces: asyncio.Queue[str], task: asyncio.Task[Any],
                gone: asyncio.Future[None] | None = None,
                cancel: threading.Event | None = None) -> str | None:
    """The next piece of text, or None once the answer has ended and every piece was taken
    (the model's thread queues each piece before its result reaches the task). When ``gone``
    ends first (the client left), ``cancel`` is set and the answer's end awaited."""
    while True:
        if not pieces.empty():
            return pieces.get_nowait()
        if task.done():
            return None
        getter = asyncio.ensure_future(pieces.get())
        waiting: set[asyncio.Future[Any]] = {getter, task}
        if gone is not None and not gone.done():
            waiting.add(gone)
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        if gone is not None and gone.done() and cancel is not None:
            cancel.set()


async def _client_gone(receive: Receive) -> None:
    """Returns once the client has left (the request's body was read whole before)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _reap(future: asyncio.Future[Any]) -> None:
    """Mark the future's exception seen: a stream whose client left never reads its answer's,
    and the pipeline has logged and counted it already."""
    if not future.cancelled():
        future.exception()


async def _stream(state: ServiceState, req: MRCRequest, parsed: ChatRequest,
                  completion_id: str, receive: Receive) -> StreamingResponse:
    pieces: asyncio.Queue[str] = asyncio.Queue()
    cancel = threading.Event()
    req.on_text, req.cancel = pieces.put_nowait, cancel
    task = asyncio.create_task(_answer(state, req, parsed))
    task.add_done_callback(_reap)
    # Until the response starts, this watches for the client leaving (a request waiting for a
    # slot or its first text); from then on Starlette's response does.
    gone = asyncio.ensure_future(_client_gone(receive))
    gone.add_done_callback(_reap)
    try:
        first = await _next(pieces, task, gone, cancel)
        if first is None:
            task.result()  # the chain refused the request: its error, with its status
    except BaseException:
        cancel.set()
        raise
    finally:
        gone.cancel()
    # A cache hit hands its text on and ends in one step of the task, so a task not done
    # by now is no cache hit.
    cached = task.done() and task.exception() is None and bool(task.result()["cached"])
    model = _served_model(state) or ""
    events = _events(first, pieces, task, parsed, completion_id, model)

    def close() -> None:
        # Not done: the client left mid-stream. The generation stops at its next token and
        # the request's log line says client_closed.
        if not task.done():
            cancel.set()

    return _EventStream(events, close, headers={"Cache-Control": "no-cache",
                                                "X-Accel-Buffering": "no",
                                                **_cached_header(cached)})


async def _events(first: str | None, pieces: asyncio.Queue[str], task: asyncio.Task[Any],
                  parsed: ChatRequest, completion_id: str, model: str) -> AsyncIterator[bytes]:
    created = int(time.time())
    with_usage = parsed.include_usage

    def event(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return _event(chunk(completion_id, created, model, delta, finish_reason, with_usage))

    yield event({"role": "assistant", "content": ""})
    text = first
    while text is not None:
        yield event({"content": text})
        text = await _next(pieces, task)
    try:
        body = task.result()
    except ServiceError as exc:
        yield _event(error_json(CHAT_PATH, exc.status, exc.code, exc.message, exc.param))
        yield _DONE
        return
    except Exception:
        log.exception("request %s: the answer failed after its stream began",
                      completion_id.removeprefix("chatcmpl-"))
        yield _event(error_json(CHAT_PATH, 500, "internal", "internal error"))
        yield _DONE
        return
    yield event({}, body.get("finish_reason", "stop"))
    if with_usage:
        yield _event({"id": completion_id, "object": "chat.completion.chunk",
                      "created": created, "model": model, "system_fingerprint": None,
                      "choices": [], "usage": usage(body)})
    yield _DONE


class _EventStream(StreamingResponse):
    """A server-sent event stream that calls ``on_close`` however it ends: sent whole, or cut
    by the client leaving (cancelled by Starlette's disconnect watch, or a failed write under
    ASGI 2.4 servers, which is logged once here instead of as a body that never came)."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None],
                 headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            # Not the "body never came" the middleware would log: on_close handles it, and
            # the request's own log line says client_closed.
            log.debug("%s: a write failed: the client left mid-stream", CHAT_PATH)
        finally:
            self._on_close()
