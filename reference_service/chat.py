"""The OpenAI chat API's request and answer shapes, for ``POST /v1/chat/completions``.

:func:`parse_chat` reads a decoded JSON body into a :class:`ChatRequest` — one prompt, one image,
a token budget — or raises :class:`~mrc_agent.reference_service.errors.ServiceError` with the
field at fault as ``param``. The model answers one question about one image, so:

* **messages** — a non-empty list of ``{"role", "content"}``; roles ``system``, ``developer``,
  ``user`` and ``assistant`` (``tool`` and ``function``: 400 ``unsupported``). ``content`` is a
  string or a list of parts ``{"type": "text", "text"}`` and ``{"type": "image_url",
  "image_url": {"url"}}`` (``detail`` is ignored); any other part type is 400 ``unsupported``.
  The prompt is the text of every message, in order, joined by newlines: the model's template
  frames it as one user turn.
* **the image** — exactly one ``image_url`` part in the whole request: none is 400
  ``invalid_value``, two or more are 400 ``unsupported`` (never "the first one": a client that
  sent two expects both to be looked at). A ``data:`` URL is decoded as ``/mrc`` decodes
  ``image`` (400 ``bad_base64``, 413 ``image_too_large``); anything else is an ``image_url`` for
  the fetch rules (:mod:`~mrc_agent.reference_service.fetch`: http(s) only, allowlist, no
  private addresses, size and time limits).
* **model** — optional (vLLM's reading); when given, the served model's id or 404
  ``model_not_found``.
* **max_completion_tokens**, or the older **max_tokens** — a JSON integer, 1 to the service's
  limit (400 ``invalid_value`` otherwise), 64 when neither is given (``/mrc``'s default). The
  newer name wins when both are given, as in vLLM.
* **stream** (a boolean) and **stream_options** (``{"include_usage": bool}``, only with a
  stream, as the OpenAI API requires).
* What would change the answer's meaning and is not done is refused, 400 ``unsupported``:
  ``n`` other than 1, ``tools``/``functions``, ``stop`` sequences, ``logprobs``, a
  ``response_format`` other than text. Sampling knobs
  (``temperature``, ``top_p``, ``seed``, penalties) and unknown fields are accepted and ignored:
  the service decodes greedily.

Limits and codes are the service's: the prompt over ``max_prompt_chars`` is 413
``prompt_too_long``, text that is no valid Unicode 400 ``invalid_value``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.preprocess import decode_base64
from mrc_agent.reference_service.settings import Settings

#: ``max_completion_tokens`` when the request gives none: ``/mrc``'s ``max_new_tokens`` default.
DEFAULT_MAX_TOKENS = 64
_ROLES = frozenset({"system", "developer", "user", "assistant"})
_REFUSED = {"n": "one choice per request (n = 1)", "tools": "no tools",
            "functions": "no functions", "stop": "no stop sequences",
            "logprobs": "no log probabilities", "top_logprobs": "no log probabilities",
            "response_format": "text answers"}
#: The values of refused fields that ask for nothing more than the service does.
_HARMLESS: dict[str, Any] = {"n": 1, "top_logprobs": 0, "response_format": {"type": "text"}}
#: Codes of the image's own faults: their ``param`` is the image part.
IMAGE_CODES = frozenset({"bad_base64", "image_empty", "url_not_allowed", "image_too_large",
                         "decompression_bomb", "fetch_too_large", "not_an_image",
                         "image_truncated", "image_corrupt", "fetch_failed", "fetch_timeout",
                         "decode_timeout"})


@dataclass
class ChatRequest:
    """A chat request as the pipeline takes it."""

    prompt: str
    max_tokens: int
    stream: bool
    include_usage: bool
    #: The decoded bytes of a ``data:`` URL image, or None when the image is ``image_url``.
    image: bytes | None
    image_url: str | None
    #: Where the image part is, for errors about it: ``messages[0].content[1].image_url.url``.
    image_param: str


def _invalid(param: str | None, message: str) -> ServiceError:
    return ServiceError.of("invalid_value", message, param)


def _unsupported(param: str, message: str) -> ServiceError:
    return ServiceError.of("unsupported", message, param)


def _refused_present(name: str, value: Any) -> bool:
    """Whether a refused field asks for something: absent, null, false, empty and the
    :data:`_HARMLESS` values do not."""
    if value is None or value is False or value == [] or value == "":
        return False
    harmless = _HARMLESS.get(name)
    return not (harmless is not None and type(value) is type(harmless) and value == harmless)


def _integer(body: dict[str, Any], name: str, limit: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:  # JSON true, 1.0 and "5" are not token counts
        raise _invalid(name, f"{name} must be an integer, got {json_type(value)}")
    if not 1 <= value <= limit:
        raise _invalid(name, f"{name} must be 1-{limit}, got {value}")
    return value


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _texts_and_images(messages: Any) -> tuple[list[str], list[tuple[str, str]]]:
    """The texts of ``messages`` in order, and each image URL with its ``param``."""
    if not isinstance(messages, list):
        raise _invalid("messages", "messages is required: a non-empty array of "
                       f"{{role, content}} objects, got {json_type(messages)}")
    if not messages:
        raise _invalid("messages", "messages must not be empty")
    texts: list[str] = []
    images: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _invalid(where, f"{where} must be an object, got {json_type(message)}")
        role = message.get("role")
        if not isinstance(role, str):
            raise _invalid(f"{where}.role", f"{where}.role is required: a string")
        if role not in _ROLES:
            if role in ("tool", "function"):
                raise _unsupported(f"{where}.role", f"{where}.role {role!r}: this model "
                                   "takes no tools")
            raise _invalid(f"{where}.role", f"{where}.role must be one of "
                           f"{', '.join(sorted(_ROLES))}, got {role!r}")
        content = message.get("content")
        if content is None and role == "assistant":
            continue
        if isinstance(content, str):
            texts.append(content)
            continue
        if not isinstance(content, list):
            raise _invalid(f"{where}.content", f"{where}.content must be a string or an "
                           f"array of content parts, got {json_type(content)}")
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(part, dict):
                raise _invalid(at, f"{at} must be an object, got {json_type(part)}")
            kind = part.get("type")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise _invalid(f"{at}.text", f"{at}.text must be a string, got "
                                   f"{json_type(text)}")
                texts.append(text)
            elif kind == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else None
                if not isinstance(url, str):
                    raise _invalid(f"{at}.image_url", f"{at}.image_url must be an object "
                                   "with a string url")
                images.append((url, f"{at}.image_url.url"))
            elif isinstance(kind, str):
                raise _unsupported(f"{at}.type", f"{at}.type {kind!r} is not supported: "
                                   "content parts are 'text' and 'image_url'")
            else:
                raise _invalid(f"{at}.type", f"{at}.type is required: 'text' or 'image_url'")
    return texts, images


def parse_chat(body: Any, settings: Settings, served_model: str | None) -> ChatRequest:
    """A decoded JSON body as a :class:`ChatRequest`, by the rules in the module docstring
    (``served_model`` None: no model is loaded yet, and the pipeline answers 503)."""
    if not isinstance(body, dict):
        raise _invalid(None, f"the body must be a JSON object, got {json_type(body)}")
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise _invalid("model", f"model must be a string, got {json_type(model)}")
        if served_model is not None and model != served_model:
            raise ServiceError.of("model_not_found", f"the model {model!r} does not exist: "
                                  f"this service serves {served_model!r}", "model")
    for name, what in _REFUSED.items():
        if _refused_present(name, body.get(name)):
            raise _unsupported(name, f"{name}: this service gives {what}")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid("stream", f"stream must be a boolean, got {json_type(stream)}")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _invalid("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(options, dict):
            raise _invalid("stream_options", "stream_options must be an object, got "
                           f"{json_type(options)}")
        usage = options.get("include_usage", False)
        if not isinstance(usage, bool):
            raise _invalid("stream_options.include_usage",
                           f"stream_options.include_usage must be a boolean, got "
                           f"{json_type(usage)}")
        include_usage = usage
    limit = settings.max_new_tokens_limit
    max_tokens = _integer(body, "max_completion_tokens", limit)
    older = _integer(body, "max_tokens", limit)
    if max_tokens is None:
        max_tokens = older if older is not None else DEFAULT_MAX_TOKENS
    texts, images = _texts_and_images(body.get("messages"))
    prompt = "\n".join(texts)
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, e.g. JSON's "\ud800"
        raise _invalid("messages", f"the messages' text is not valid Unicode (character "
                       f"{exc.start} is a lone surrogate)") from None
    if len(prompt) > settings.max_prompt_chars:
        raise ServiceError.of("prompt_too_long", f"the messages' text has {len(prompt)} "
                              f"characters; the limit is {settings.max_prompt_chars}", "messages")
    if not images:
        raise _invalid("messages", "the request has no image: this model answers a question "
                       "about one image, sent as a content part {\"type\": \"image_url\", "
                       "\"image_url\": {\"url\": …}}")
    if len(images) > 1:
        raise _unsupported(images[1][1], f"the request has {len(images)} images "
                           f"({', '.join(p for _, p in images)}); this model takes one image "
                           "per request")
    url, param = images[0]
    image = image_url = None
    if url[:5].lower() == "data:":
        try:
            image = decode_base64(url, settings.max_image_bytes)
        except ServiceError as exc:
            exc.param = param
            raise
    else:
        image_url = url
    return ChatRequest(prompt=prompt, max_tokens=max_tokens, stream=bool(stream),
                       include_usage=include_usage, image=image, image_url=image_url,
                       image_param=param)


def usage(body: dict[str, Any]) -> dict[str, int]:
    """The OpenAI ``usage`` of an answer from the pipeline."""
    prompt, completion = int(body["input_tokens"]), int(body["output_tokens"])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion(completion_id: str, model: str, body: dict[str, Any]) -> dict[str, Any]:
    """The ``chat.completion`` object of a whole answer."""
    return {"id": completion_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "logprobs": None,
                         "finish_reason": body.get("finish_reason", "stop"),
                         "message": {"role": "assistant", "content": body["answer"],
                                     "refusal": None}}],
            "usage": usage(body)}


def chunk(completion_id: str, created: int, model: str, delta: dict[str, Any],
          finish_reason: str | None = None, with_usage: bool = False) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of a streamed answer (``usage`` null in each, as the
    OpenAI API sends it when the final chunk carries it)."""
    out: dict[str, Any] = {
        "id": completion_id, "object": "chat.completion.chunk", "created": created,
        "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": None,
                     "finish_reason": finish_reason}]}
    if with_usage:
        out["usage"] = None
    return out
