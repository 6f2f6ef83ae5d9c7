"""``POST /mrc`` (JSON, base64 image or image URL) and ``POST /mrc/upload`` (multipart).

Bodies are parsed by hand rather than by FastAPI's automatic validation so that every client
mistake — invalid UTF-8, malformed JSON, a missing or doubled image field, a prompt or token
budget out of range — gets the service's own JSON error with the right status, never a 500.

``max_new_tokens`` is an integer written as one, and nothing else is taken for one (422
``invalid_request``): in JSON a JSON integer (``true``, ``1.0``, ``1e1`` and ``"5"`` are not:
a lax reading took ``true`` as 1), in a form an ASCII decimal integer, optionally negative
(``--5``, ``+5``, ``1e3``, ``٣`` are not: ``--5`` passed a digit check and made ``int()`` raise).
"""

from __future__ import annotations

import json
import re
import uuid
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser, parse_options_header
from starlette.requests import ClientDisconnect

from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.middleware import BodyTooLarge
from mrc_agent.reference_service.pipeline import MRCRequest, answer
from mrc_agent.reference_service.preprocess import decode_base64
from mrc_agent.reference_service.settings import Settings
from mrc_agent.reference_service.state import ServiceState

router = APIRouter()

#: The paths of MRC requests: each is counted once in ``mrc_requests_total``, by outcome.
MRC_PATHS = frozenset({"/mrc", "/mrc/upload"})
#: A form's token budget: ASCII digits ("²" and "٣" pass str.isdigit(), which int() refuses or
#: reads), an optional minus (the range check says what the limit is), and few of them.
_FORM_INTEGER = re.compile(r"-?[0-9]{1,9}")


class MRCBody(BaseModel):
    """The JSON body of ``POST /mrc``: exactly one of ``image`` and ``image_url``."""

    model_config = ConfigDict(extra="forbid")
    image: str | None = Field(None, description="base64 image bytes or a base64 data URL")
    image_url: str | None = Field(None, description="http(s) URL of the image")
    text_prompt: str = Field(..., description="the question about the image")
    max_new_tokens: int = Field(64, strict=True, description="tokens to generate at most")

    @model_validator(mode="after")
    def _one_image(self) -> MRCBody:
        if (self.image is None) == (self.image_url is None):
            raise ValueError("give exactly one of 'image' and 'image_url'")
        return self


class MRCAnswer(BaseModel):
    answer: str
    latency_ms: float
    ttft_ms: float
    cached: bool
    request_id: str
    input_tokens: int
    output_tokens: int
    truncated: bool
    ocr_text: str
    meaningful: bool


class _NotUTF8(MultiPartException):
    pass


class _StrictMultiPart(MultiPartParser):
    """Starlette's multipart parser, except that a field or field name that is not valid UTF-8
    (the charset unless the body says otherwise) is an error: Starlette falls back to Latin-1
    and hands on mojibake as if the client had meant it."""

    def _strict(self, raw: bytes | bytearray, what: str) -> None:
        if self._charset == "utf-8":
            try:
                bytes(raw).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _NotUTF8(f"{what} is not valid UTF-8 (byte {exc.start})") from None

    def on_part_end(self) -> None:
        if self._current_part.file is None:
            self._strict(self._current_part.data,
                         f"form field {self._current_part.field_name!r}")
        super().on_part_end()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._current_part.content_disposition)
        for key in (b"name", b"filename"):
            if key in options:
                self._strict(options[key], f"a form part's {key.decode()}")
        super().on_headers_finished()


async def _form(request: Request, settings: Settings) -> FormData:
    async with aclosing(request.stream()) as stream:
        return await _StrictMultiPart(request.headers, stream, max_files=1, max_fields=8,
                                      max_part_size=4 * settings.max_prompt_chars + 1024).parse()


def _state(request: Request) -> ServiceState:
    return request.app.state.mrc  # type: ignore[no-any-return]


def _check_text(prompt: str, max_new_tokens: int, settings: Settings) -> None:
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, e.g. JSON's "\ud800"
        raise ServiceError.of("invalid_request", f"text_prompt is not valid Unicode (character "
                              f"{exc.start} is a lone surrogate)") from None
    if len(prompt) > settings.max_prompt_chars:
        raise ServiceError.of("prompt_too_long", f"text_prompt has {len(prompt)} characters; "
                              f"the limit is {settings.max_prompt_chars}")
    if not 1 <= max_new_tokens <= settings.max_new_tokens_limit:
        raise ServiceError.of("invalid_request", f"max_new_tokens must be 1-"
                              f"{settings.max_new_tokens_limit}, got {max_new_tokens}")


def json_body(raw: bytes) -> Any:
    """A request body as JSON: 400 ``invalid_utf8`` or ``bad_request`` when it is none."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ServiceError.of("invalid_utf8",
                              f"the body is not valid UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ServiceError.of("bad_request", f"the body is not valid JSON: {exc.msg} "
                              f"(line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise ServiceError.of("bad_request", "the body is nested too deeply") from None
    except ValueError as exc:  # an integer literal longer than Python converts
        raise ServiceError.of("bad_request", f"the body is not valid JSON: {exc}") from None


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "__root__")
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


@router.post("/mrc", response_model=MRCAnswer, openapi_extra={"requestBody": {
    "content": {"application/json": {"schema": MRCBody.model_json_schema()}},
    "required": True}})
async def mrc_json(request: Request) -> dict[str, Any]:
    state = _state(request)
    obj = json_body(await request.body())
    try:
        body = MRCBody.model_validate(obj)
    except ValidationError as exc:
        raise ServiceError.of("invalid_request", _validation_message(exc)) from None
    _check_text(body.text_prompt, body.max_new_tokens, state.settings)
    image = None
    if body.image is not None:
        image = decode_base64(body.image, state.settings.max_image_bytes)
    req = MRCRequest(request_id=uuid.uuid4().hex, prompt=body.text_prompt,
                     max_new_tokens=body.max_new_tokens, image=image, image_url=body.image_url)
    return await answer(state, req)


@router.post("/mrc/upload", response_model=MRCAnswer)
async def mrc_upload(request: Request) -> dict[str, Any]:
    state = _state(request)
    settings = state.settings
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ServiceError.of("invalid_request", "send multipart/form-data with 'file', "
                              "'text_prompt' and optionally 'max_new_tokens'")
    try:
        form = await _form(request, settings)
    except _NotUTF8 as exc:
        raise ServiceError.of("invalid_utf8", exc.message) from None
    except (BodyTooLarge, ClientDisconnect):
        raise  # the body limit answers 413 itself, and logs a client gone away once
    except MultiPartException as exc:
        raise ServiceError.of("bad_request", f"malformed multipart body: {exc.message}") from None
    except Exception as exc:  # python-multipart parse errors: the client's body
        raise ServiceError.of("bad_request", f"malformed multipart body: {exc}") from None
    try:
        upload = form.get("file")
        prompt = form.get("text_prompt")
        tokens_raw = form.get("max_new_tokens", "64")
        if upload is None or isinstance(upload, str):
            raise ServiceError.of("invalid_request", "the 'file' part (the image) is missing")
        if not isinstance(prompt, str):
            raise ServiceError.of("invalid_request", "the 'text_prompt' field is missing")
        digits = tokens_raw.strip() if isinstance(tokens_raw, str) else ""
        if not _FORM_INTEGER.fullmatch(digits):
            raise ServiceError.of("invalid_request", "max_new_tokens must be an integer, "
                                  f"1-{settings.max_new_tokens_limit}")
        max_new_tokens = int(digits)
        _check_text(prompt, max_new_tokens, settings)
        data = await upload.read(settings.max_image_bytes + 1)
        if len(data) > settings.max_image_bytes:
            raise ServiceError.of("image_too_large", f"the image is over "
                                  f"{settings.max_image_bytes} bytes")
    finally:
        await form.close()
    req = MRCRequest(request_id=uuid.uuid4().hex, prompt=prompt, max_new_tokens=max_new_tokens,
                     image=data)
    return await answer(state, req)
