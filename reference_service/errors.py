"""The reference service's own error type: one exception that carries its HTTP status and code.

Every failure the service can put into words is a :class:`ServiceError`; the app turns it into
``{"error": {"code": …, "message": …}}`` with :attr:`ServiceError.status`, or, on the OpenAI
API's paths (:data:`OPENAI_PREFIX`), into the OpenAI shape ``{"error": {"message", "type",
"param", "code"}}`` with the same status and code (:func:`error_json`). Anything else reaching
the app is a bug and becomes a 500 — bad input must never get there.

Codes are short and stable (clients and the ``outcome`` metric depend on them); messages are
for humans and may change. Status per code, and why:

=====================  ======  ==============================================================
code                   status  why
=====================  ======  ==============================================================
bad_request            400     malformed request the schema could not catch (generic).
bad_base64             400     ``image`` is not strict base64 / not a base64 data URL.
invalid_utf8           400     the body or a form field is not valid UTF-8.
image_empty            400     zero bytes, or a header that says 0 pixels: nothing to look at.
url_not_allowed        400     ``image_url`` scheme, host or resolved address is refused
                               (non-http(s), not on the allowlist, loopback, private,
                               link-local, …) — also for a redirect hop. The client chose it.
image_too_large        413     more bytes than ``max_image_bytes`` (checked on the base64
                               text before decoding, and on the raw bytes).
decompression_bomb     413     the header claims more than ``max_image_pixels`` pixels (or
                               Pillow's own bomb check fired); refused before decoding.
fetch_too_large        413     the ``image_url`` body exceeded ``max_image_bytes`` while
                               streaming (or its Content-Length said it would).
prompt_too_long        413     ``text_prompt`` longer than ``max_prompt_chars``.
not_an_image           415     the bytes are no image format the service decodes.
image_truncated        422     the stream ends before the image does (truncated upload, or a
                               JPEG too short for the size its header claims).
image_corrupt          422     a recognised format whose data cannot be decoded, or whose
                               structure holds more segments, chunks or blocks than any real
                               image (a crafted header, refused before it is parsed).
invalid_request        422     schema errors: neither/both of ``image``/``image_url``,
                               ``max_new_tokens`` not an integer or out of range, wrong types.
invalid_value          400     the OpenAI API's schema errors (``/v1/chat/completions``): a
                               field missing, of the wrong type or out of range, no image.
                               400, as the OpenAI API and vLLM answer them.
unsupported            400     an OpenAI API request asks for what the model does not do: a
                               second image, a content part other than text and image_url,
                               tools, ``n`` > 1, stop sequences, log probabilities, JSON mode.
model_not_found        404     ``model`` names a model other than the one served.
client_closed          499     the client left before its streamed answer was complete
                               (nginx's 499): nobody reads it; counted as a client error.
overloaded             429     queue full; the app adds ``Retry-After``.
fetch_failed           502     the ``image_url`` host failed us: DNS failure, connection
                               error, non-2xx answer, too many redirects.
decode_unavailable     503     the service's state, not the image's: too many header parses
                               or decodes are stuck past their timeout (new ones are refused
                               until they drain, see ``preprocess.DecodePool``), every header
                               or decode thread stayed busy, or a header was not read within
                               ``header_timeout_s``. The app adds ``Retry-After``.
model_not_ready        503     the model is still loading or warming up.
decode_timeout         504     decoding/preprocessing ran past ``decode_timeout_s``.
fetch_timeout          504     fetching ``image_url`` ran past ``fetch_timeout_s``.
=====================  ======  ==============================================================

4xx means "the request was wrong, do not retry it as is"; 502/504 mean "an upstream or a step
took too long or failed, a retry may work"; 503/429 mean "come back later".
"""

from __future__ import annotations

from typing import Any

#: code -> HTTP status. The single source of truth for the table above.
STATUS_BY_CODE: dict[str, int] = {
    "bad_request": 400,
    "bad_base64": 400,
    "invalid_utf8": 400,
    "image_empty": 400,
    "url_not_allowed": 400,
    "image_too_large": 413,
    "decompression_bomb": 413,
    "fetch_too_large": 413,
    "prompt_too_long": 413,
    "not_an_image": 415,
    "image_truncated": 422,
    "image_corrupt": 422,
    "invalid_request": 422,
    "invalid_value": 400,
    "unsupported": 400,
    "model_not_found": 404,
    "client_closed": 499,
    "overloaded": 429,
    "fetch_failed": 502,
    "decode_unavailable": 503,
    "model_not_ready": 503,
    "decode_timeout": 504,
    "fetch_timeout": 504,
}


#: Paths answered in the OpenAI API's shapes, their errors included.
OPENAI_PREFIX = "/v1/"


class ServiceError(Exception):
    """A failure with an HTTP ``status``, a stable machine ``code`` and a human ``message``.

    ``ServiceError(status, code, message)`` states all three; :meth:`of` takes the status from
    :data:`STATUS_BY_CODE`, so modules raising table codes cannot drift from the table.
    ``param`` names the request field at fault, for the OpenAI API's error shape (None: none
    in particular).
    """

    status: int
    code: str
    message: str
    param: str | None

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.param = param

    @classmethod
    def of(cls, code: str, message: str, param: str | None = None) -> ServiceError:
        """The error for a code of the table above (KeyError for an unknown code: a bug)."""
        return cls(STATUS_BY_CODE[code], code, message, param)

    @property
    def is_client_error(self) -> bool:
        """True for 4xx: the request itself was at fault (the ``client_error`` outcome)."""
        return 400 <= self.status < 500

    def to_json(self) -> dict[str, Any]:
        """The response body the app sends: ``{"error": {"code": …, "message": …}}``."""
        return {"error": {"code": self.code, "message": self.message}}

    def __repr__(self) -> str:
        return f"ServiceError(code={self.code!r}, status={self.status}, message={self.message!r})"


def openai_error_type(status: int) -> str:
    """The OpenAI error ``type`` of a status: ``invalid_request_error`` for the client's
    mistakes, ``rate_limit_error`` for 429, ``server_error`` for the service's failures."""
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_json(path: str, status: int, code: str, message: str,
               param: str | None = None) -> dict[str, Any]:
    """The error body for a request to ``path``: the service's shape, or on the OpenAI API's
    paths the OpenAI one (``code`` is the service's code either way)."""
    if path.startswith(OPENAI_PREFIX):
        return {"error": {"message": message, "type": openai_error_type(status),
                          "param": param, "code": code}}
    return {"error": {"code": code, "message": message}}
