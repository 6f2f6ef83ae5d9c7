"""The OpenAI meter: the MRC request metrics for any OpenAI-compatible server, from the wire.

vLLM, SGLang, TGI and Triton's OpenAI frontend export no request metrics by prompt length × image
resolution, and their time to first token starts after the upload and the image decode. The meter
reads what crosses the wire of ``POST /v1/chat/completions`` and ``POST /v1/completions`` and
records the library's own families (:mod:`mrc_agent.exporters.instrumentation.families`) under
their own names and labels, so the shipped dashboards and alerts work unchanged. Two ways in share
this module: the ASGI middleware (:mod:`mrc_agent.exporters.instrumentation.middleware`) and the
streaming proxy (``mrc-agent proxy``); each hands an :class:`Exchange` the bytes it forwards.

What it records, and from what:

* **prompt length** — characters (``len`` of the decoded text, as the library counts) of every
  text in ``messages`` (string contents and ``text`` parts, every role) or of ``prompt``;
* **resolution** — of the largest image, read from its first bytes: a ``data:`` URL's (or bare)
  base64 is decoded up to :data:`IMAGE_HEAD_BYTES` and its header walked by
  :func:`mrc_agent.exporters.imagewalk.walk`, bounded by count. A remote ``http(s)`` URL is never
  fetched: it puts the request in the ``unknown`` cell, as does an image whose size its first
  bytes do not tell; when any image is unknown, so is the largest. No image at all is 0 pixels,
  ``<1MP``. The image count goes to ``mrc_request_images``;
* **time to first token** — the first server-sent event carrying content (``delta.content``,
  ``delta.reasoning_content``/``reasoning``, ``delta.tool_calls`` or a completion's ``text``)
  of a streamed answer. A non-streamed answer has no first token on the wire: its TTFT is not
  observed (its duration is);
* **time per output token** — from the first content event to the last, over the completion
  tokens in ``usage``; a stream without ``usage`` has none (its events are not tokens: an engine
  may put several tokens in one);
* **tokens** — ``usage.prompt_tokens`` and ``usage.completion_tokens`` when the answer carries
  them, and nothing when it does not. The meter never changes a request to obtain them (a stream
  has ``usage`` only when the client asked, with ``stream_options.include_usage``, and the server
  honours it);
* **outcome** — from the status: a client that leaves before the answer ends is 499
  (``client_error``, as nginx counts it); an upstream that fails after its status, or an error
  event in a stream, is ``error``;
* **receive** stage — from the request's first byte seen to its last;
* **in flight** — the tracker's gauge, while the exchange lasts.

Work is bounded per byte and state per request (:mod:`~.jsonscan`): the body is never held
(large ones stream through), an event of a stream is kept only up to :data:`EVENT_LIMIT` bytes,
and an image's head only up to :data:`IMAGE_HEAD_BYTES`.
"""

from __future__ import annotations

import binascii
import json
import logging
import re
import struct
from collections.abc import Iterable
from time import monotonic, perf_counter
from typing import Any

from mrc_agent.exporters.imagewalk import StructureError, walk
from mrc_agent.exporters.instrumentation.families import MeterStage
from mrc_agent.exporters.instrumentation.jsonscan import CAPTURE, COUNT, ITEM, SKIP, JsonScanner
from mrc_agent.exporters.instrumentation.metrics import MRCMetrics, RequestTracker

log = logging.getLogger(__name__)

#: The request paths metered (a suffix match: a server under a root path is metered too).
METERED_PATHS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions")
#: Decoded bytes of an image read for its size: a JPEG's frame header follows its EXIF and ICC
#: segments (64 KiB each at most, one ICC profile rarely more than a few).
IMAGE_HEAD_BYTES = 192 * 1024
#: Bytes of one server-sent event parsed for content and usage; a larger one (no real chunk is)
#: counts as content without being parsed.
EVENT_LIMIT = 64 * 1024
#: A body that arrives in one piece of at most this many bytes is parsed by ``json`` (in C, a
#: few microseconds) instead of the incremental scan; larger or split ones stream through it.
WHOLE_LIMIT = 64 * 1024
#: The largest token count believed: 2**53, past which a float (a counter's value) no longer
#: holds every whole number. No request comes near it (a million-token context is 2**20); a
#: larger ``usage`` number is a broken or hostile upstream's, and counts as no usage at all.
MAX_COUNT = 2**53
#: The largest image side believed, in pixels: PNG's and TIFF's own limit (2**31 - 1). A size
#: outside 1..MAX_SIDE (a BMP's negative width, a zero height) is a crafted header's: unknown.
MAX_SIDE = 2**31 - 1
#: The status a client gets counted with when it leaves before the answer ends (nginx's).
CLIENT_CLOSED = 499
_STATUS_FAILED = 502

_MESSAGE_TEXT = {("messages", ITEM, "content"), ("messages", ITEM, "content", ITEM, "text"),
                 ("prompt",), ("prompt", ITEM)}
_IMAGE_URL = {("messages", ITEM, "content", ITEM, "image_url", "url"),
              ("messages", ITEM, "content", ITEM, "image_url")}
_B64_HEAD_CHARS = (IMAGE_HEAD_BYTES // 3) * 4
_B64_FIRST_CHARS = 1024
_DATA_URL_HEADER = 512
_WHITESPACE = b" \t\r\n"
_URLSAFE = bytes.maketrans(b"-_", b"+/")
_PNG_IHDR = b"\x89PNG\r\n\x1a\n"
_PNG_SIZE = struct.Struct(">II")


class _Found(Exception):
    def __init__(self, width: int, height: int) -> None:
        super().__init__(width, height)
        self.size = (width, height)


def _stop_at_size(width: int, height: int) -> None:
    raise _Found(width, height)


def image_size(url: bytes) -> tuple[int, int] | None:
    """Width and height of the image a request's ``url`` carries, from its first bytes; None when
    they do not tell (a remote URL, not an image, a header past the head or a crafted one)."""
    head = url[:16].lower()
    if head.startswith((b"http://", b"https://")):
        return None
    begin = 0
    if head.startswith(b"data:"):
        comma = url.find(b",", 0, _DATA_URL_HEADER)
        if comma < 0 or b";base64" not in url[:comma].lower():
            return None
        begin = comma + 1
    # A PNG's size is in its first 24 bytes (signature, IHDR): 32 characters, read without the
    # walk, which would stop there with the same size (an eighth of the cost).
    text = url[begin:begin + 96].translate(_URLSAFE, _WHITESPACE)[:32]
    if len(text) == 32 and b"=" not in text:
        try:
            data = binascii.a2b_base64(text)
        except (binascii.Error, ValueError):
            return None
        if len(data) == 24 and data.startswith(_PNG_IHDR) and data[12:16] == b"IHDR":
            return _believable(_PNG_SIZE.unpack_from(data, 16))
    # Most headers (PNG, GIF, WebP, BMP, a JPEG without a large EXIF) tell the size within the
    # first 768 bytes: decode those first, the whole head only when they do not.
    for chars in (_B64_FIRST_CHARS, _B64_HEAD_CHARS):
        text = url[begin:begin + chars + 64].translate(_URLSAFE, _WHITESPACE)
        pad = text.find(b"=")
        if pad >= 0:
            text = text[:pad]
        short = len(text) < chars
        text = text[:min(chars, len(text) - len(text) % 4)]
        try:
            data = binascii.a2b_base64(text)
        except (binascii.Error, ValueError):
            return None
        try:
            layout = walk(data, _stop_at_size)
        except _Found as found:
            return _believable(found.size)
        except StructureError:
            return None
        if layout is None or short or pad >= 0:
            return _believable(layout.size) if layout is not None else None
    return None


def _believable(size: tuple[int, int] | None) -> tuple[int, int] | None:
    """``size`` when both sides are whole numbers from 1 to :data:`MAX_SIDE`, else None."""
    if size is None:
        return None
    width, height = size
    if (isinstance(width, int) and isinstance(height, int) and 0 < width <= MAX_SIDE
            and 0 < height <= MAX_SIDE):
        return width, height
    return None


class ChatRequestScan(JsonScanner):
    """What the meter reads from a request body: prompt characters, images, ``stream``."""

    capture_limit = _DATA_URL_HEADER + _B64_HEAD_CHARS + 64

    def __init__(self) -> None:
        super().__init__()
        self.prompt_chars = 0
        self.images = 0
        #: Pixels of the largest image so far, and its size; None once an image is unknown.
        self.largest: tuple[int, int] | None = (0, 0)
        self.stream = False

    def mode(self, path: tuple[str | None, ...]) -> int:
        if path in _MESSAGE_TEXT:
            return COUNT
        if path in _IMAGE_URL:
            return CAPTURE
        return SKIP

    def string(self, path: tuple[str | None, ...], value: bytes | int, cut: bool) -> None:
        if isinstance(value, int):
            self.prompt_chars += value
            return
        self.images += 1
        size = image_size(value)
        if size is None:
            self.largest = None
        elif self.largest is not None and size[0] * size[1] >= self.largest[0] * self.largest[1]:
            self.largest = size

    def literal(self, path: tuple[str | None, ...], text: bytes) -> None:
        if path == ("stream",):
            self.stream = text == b"true"

    def whole(self, body: bytes) -> None:
        """Read a body that arrived whole and small (:data:`WHOLE_LIMIT`) with the C parser:
        the same values as the scan, a tenth of its cost."""
        doc = _loads(body)
        if doc is None:
            self.failed = "not JSON"
            return
        if not isinstance(doc, dict):
            return
        self.stream = doc.get("stream") is True
        prompt = doc.get("prompt")
        for text in (prompt if isinstance(prompt, list) else [prompt]):
            if isinstance(text, str):
                self.prompt_chars += len(text)
        messages = doc.get("messages")
        for message in messages if isinstance(messages, list) else ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                self.prompt_chars += len(content)
            for part in content if isinstance(content, list) else ():
                if not isinstance(part, dict):
                    continue
                text, url = part.get("text"), part.get("image_url")
                if isinstance(text, str):
                    self.prompt_chars += len(text)
                if isinstance(url, dict):
                    url = url.get("url")
                if isinstance(url, str):
                    self.string((), url.encode("utf-8", "surrogatepass"), False)


class UsageScan(JsonScanner):
    """``usage`` of a non-streamed answer."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None

    def literal(self, path: tuple[str | None, ...], text: bytes) -> None:
        if len(path) == 2 and path[0] == "usage":
            n = _count(text)
            if path[1] == "prompt_tokens":
                self.prompt_tokens = n
            elif path[1] == "completion_tokens":
                self.completion_tokens = n

    def whole(self, body: bytes) -> None:
        """Read an answer that arrived whole and small: ``usage`` comes last in the answers
        of OpenAI, vLLM, SGLang and TGI, so only what follows its last ``"usage"`` key is read
        (generated text cannot hold that key unescaped); the C parser reads the rest when the
        numbers are not there."""
        at = body.rfind(b'"usage"')
        if at < 0:
            return
        found = dict(_USAGE_NUMBERS.findall(body, at))
        if b"completion" in found:
            self.completion_tokens = _count(found[b"completion"])
            self.prompt_tokens = _count(found[b"prompt"]) if b"prompt" in found else None
            return
        doc = _loads(body)
        usage = doc.get("usage") if isinstance(doc, dict) else None
        if isinstance(usage, dict):
            self.prompt_tokens = _count(usage.get("prompt_tokens"))
            self.completion_tokens = _count(usage.get("completion_tokens"))


def _loads(body: bytes) -> Any:
    """``json.loads`` of a small body, None when it is not JSON. Undecodable bytes stay one
    character each (the scan counts them so too)."""
    try:
        return json.loads(body.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        return None


def _count(value: bytes | Any) -> int | None:
    """A token count: a whole number from 0 to :data:`MAX_COUNT` (as JSON bytes or as parsed),
    else None: a float, a string, a boolean, NaN, an object or an unbelievable number."""
    if isinstance(value, bytes):
        value = int(value) if value.isdigit() and len(value) <= 18 else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    return None


#: A content event: a non-empty string under one of the content keys, or a tool call. Matched on
#: the event's bytes, not parsed: an escaped quote inside generated text (``\\"content\\"``)
#: cannot match, and ``logprobs.content`` holds a list, not a string.
_CONTENT = re.compile(rb'"(?:content|reasoning_content|reasoning|text)"[ \t]*:[ \t]*"(?!")'
                      rb'|"tool_calls"[ \t]*:[ \t]*\[[ \t]*\{')
_USAGE_NUMBERS = re.compile(
    rb'"(prompt|completion)_tokens"[ \t\r\n]*:[ \t\r\n]*(\d{1,18})(?![\d.eE])')
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE = re.compile(rb"\r\n|\n|\r")


class EventScan:
    """Server-sent events of a streamed answer: content events (the first is the first token),
    ``usage``, error events. Keeps at most one unfinished event, up to :data:`EVENT_LIMIT`
    bytes; a longer one counts as content, unread. An event is classified on its bytes and
    parsed only when it carries ``usage`` or ``error``."""

    def __init__(self, exchange: Exchange) -> None:
        self._x = exchange
        # The unfinished event: its bytes, appended in place (a copy of the event per piece
        # made one written a byte at a time cost its length squared), its size (counted on
        # past EVENT_LIMIT, where the bytes are dropped) and its last 3 bytes, where an event
        # end split by a piece boundary begins.
        self._buf = bytearray()
        self._size = 0
        self._tail = b""
        self._oversize = False
        self.events = 0
        #: When the last content event was seen (``perf_counter``).
        self.last: float | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.error = False

    @property
    def pending(self) -> int:
        """Bytes of the unfinished event held (at most :data:`EVENT_LIMIT`)."""
        return len(self._buf)

    def feed(self, chunk: bytes) -> None:
        if (not self._size and chunk.startswith(b"data: ")
                and chunk.find(b"\n") == len(chunk) - 2 and chunk.endswith(b"\n\n")):
            # One whole one-line event per chunk, as servers write them: the hot path.
            value = chunk[6:-2]
            if (self.events and b'"usage"' not in value and b'"error"' not in value
                    and value != b"[DONE]"):
                self.events += 1
                self.last = perf_counter()
            else:
                self._value(value)
            return
        pos = 0
        if self._size:
            # An end that begins in the unfinished event's last bytes: the only place the new
            # bytes can complete one that the earlier searches could not see.
            tail = self._tail
            m = _EVENT_END.search(tail + chunk[:3])
            if m is not None and m.start() < len(tail):
                keep = self._size - (len(tail) - m.start())
                self._end_pending(keep)
                pos = m.end() - len(tail)
        while True:
            m = _EVENT_END.search(chunk, pos)
            if m is None:
                break
            if self._size:
                self._add(chunk[pos:m.start()])
                self._end_pending(self._size)
            else:
                self._event(chunk[pos:m.start()])
            pos = m.end()
        if pos < len(chunk):
            self._add(chunk[pos:] if pos else chunk)

    def _add(self, piece: bytes) -> None:
        """Append ``piece`` to the unfinished event."""
        if not piece:
            return
        self._size += len(piece)
        self._tail = (self._tail + piece[-3:])[-3:]
        if self._size > EVENT_LIMIT:
            self._oversize = True
            self._buf = bytearray()
        elif not self._oversize:
            self._buf += piece

    def _end_pending(self, keep: int) -> None:
        """The unfinished event ended after its first ``keep`` bytes: read it."""
        oversize = self._oversize
        block = bytes(self._buf[:keep]) if not oversize else b""
        self._buf = bytearray()
        self._size, self._tail, self._oversize = 0, b"", False
        if oversize:
            self._content()
        else:
            self._event(block)

    def close(self) -> None:
        if self._oversize:
            self._content()
        else:
            block = bytes(self._buf)
            if block.strip():
                self._event(block)
        self._buf = bytearray()
        self._size, self._tail, self._oversize = 0, b"", False

    def _event(self, block: bytes) -> None:
        if block.startswith(b"data:") and b"\n" not in block and b"\r" not in block:
            value = block[5:]  # one data line: the usual event
            if value.startswith(b" "):
                value = value[1:]
        else:
            lines = [line[5:].removeprefix(b" ") for line in _LINE.split(block)
                     if line.startswith(b"data:")]
            if not lines:
                return
            value = b"\n".join(lines)
        self._value(value)

    def _value(self, value: bytes) -> None:
        if value == b"[DONE]":
            return
        if b'"usage"' in value or b'"error"' in value:
            self._parsed(value)
            if _CONTENT.search(value):
                self._content()
        elif self.events:
            # After the first token only the last one's time matters: any event but usage,
            # an error or [DONE] stands for it (a finish event comes with the last token).
            self.events += 1
            self.last = perf_counter()
        elif _CONTENT.search(value):
            self._content()

    def _parsed(self, value: bytes) -> None:
        try:
            event = json.loads(value)
        except (ValueError, RecursionError):
            return
        if not isinstance(event, dict):
            return
        if event.get("error") is not None:
            self.error = True
        usage = event.get("usage")
        if isinstance(usage, dict):
            p, c = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
            if p is not None:
                self.prompt_tokens = p
            if c is not None:
                self.completion_tokens = c

    def _content(self) -> None:
        self.events += 1
        self.last = perf_counter()
        if self.events == 1:
            self._x.tracker.first_token()


class Exchange:
    """One metered request and its answer. The transport calls, in order: :meth:`request_body`
    for each body chunk, :meth:`response_start`, :meth:`response_body` for each chunk, and always
    :meth:`finish` (``client_left`` when the client went away before the answer ended). Each
    call costs bounded work; none raises.

    The meter never fails a request: every call catches an ``Exception`` from the meter's own
    work (a bug, or a hostile byte no test foresaw), counts it in ``mrc_meter_errors_total``
    by stage, logs it (one warning a minute per stage, with its traceback, the rest at debug)
    and marks the exchange :attr:`degraded`. Reading that stage stops; the exchange still
    ends, the request is counted by its status and leaves ``mrc_requests_in_flight``. A
    request degraded before its labels were known is counted in ``mrc_requests_total``
    only, like a request a library user rejects before its image is decoded."""

    __slots__ = ("tracker", "degraded", "_metrics", "_t0", "_scan", "_received", "_status",
                 "_resp", "_complete", "_finished", "_fed", "_whole", "_resp_fed", "_usage",
                 "_held", "_resp_held")

    def __init__(self, metrics: MRCMetrics) -> None:
        self._metrics = metrics
        self.tracker: RequestTracker = metrics.request()
        self.tracker.__enter__()
        #: The first stage whose reading failed (``METER_STAGES``), or None.
        self.degraded: MeterStage | None = None
        self._t0 = perf_counter()
        self._scan: ChatRequestScan | None = ChatRequestScan()
        self._received = False
        self._status: int | None = None
        self._resp: UsageScan | EventScan | None = None
        self._complete = False
        self._finished = False
        self._fed = self._whole = self._resp_fed = False
        self._usage: UsageScan | None = None
        # A first small chunk, kept (not copied) until the next call says whether the body
        # ended with it: a proxy hands the end over as a call of its own.
        self._held: bytes | None = None
        self._resp_held: bytes | None = None

    # --- the guard --------------------------------------------------------------------------

    def _failed(self, stage: MeterStage) -> None:
        """The meter's reading failed at ``stage`` (called from an ``except``): count it, log
        it, and stop reading what that stage reads."""
        if self.degraded is None:
            self.degraded = stage
        if stage == "request":
            self._scan, self._held, self._received = None, None, True
        elif stage == "response":
            self._resp, self._resp_held, self._usage = None, None, None
        try:
            self._metrics.meter_error(stage)
        finally:
            _log_failure(stage)

    def request_body(self, chunk: bytes, more: bool) -> None:
        """A chunk of the request body (``more``: not its last)."""
        try:
            self._request_body(chunk, more)
        except Exception:
            self._failed("request")

    def response_start(self, status: int, content_type: str) -> None:
        """The answer's status and ``Content-Type``."""
        self._status = status  # first: the outcome needs it whatever the reading does
        try:
            self._response_start(status, content_type)
        except Exception:
            self._failed("response")

    def response_body(self, chunk: bytes, more: bool) -> None:
        """A chunk of the answer (``more``: not its last)."""
        try:
            self._response_body(chunk, more)
        except Exception:
            self._failed("response")
        finally:
            if not more:
                self._complete = True  # the answer ended, whatever its reading did

    def finish(self, client_left: bool = False) -> None:
        """End the exchange: its outcome is the status when the answer ended, 499 when the
        client left first (``client_left``), 502 when the server failed before it ended."""
        if self._finished:
            return
        self._finished = True
        try:
            self._read_end()
        except Exception:
            self._failed("finish")
        t = self.tracker
        try:
            t.set_status(self._final_status(client_left))
        finally:
            try:
                t.__exit__(None, None, None)
            except Exception:
                # The tracker counted the request and left in flight before raising.
                self._failed("finish")

    # --- the reading ------------------------------------------------------------------------

    def _request_body(self, chunk: bytes, more: bool) -> None:
        scan = self._scan
        if scan is None or self._received:
            return
        held, self._held = self._held, None
        if held is not None:
            if not more and not chunk:
                chunk = held  # the body came in one piece, then its end
            else:
                scan.feed(held)
                self._fed = True
        elif more and not self._fed and 0 < len(chunk) <= WHOLE_LIMIT:
            self._held = chunk
            return
        if not more and not self._fed and len(chunk) <= WHOLE_LIMIT:
            scan.whole(chunk)
            self._whole = True
        else:
            scan.feed(chunk)
        self._fed = True
        if not more:
            self._received_all()

    def _received_all(self) -> None:
        scan = self._scan
        if scan is None or self._received:
            return
        self._received = True
        held, self._held = self._held, None
        if held is not None:
            scan.feed(held)
        if not self._whole:
            scan.close()
        t = self.tracker
        t.observe_stage("receive", perf_counter() - self._t0)
        if scan.failed is not None:
            return
        t.set_prompt(scan.prompt_chars)
        t.set_image_count(scan.images)
        if scan.largest is None:
            t.set_image_unknown()
        else:
            t.set_image(*scan.largest)

    def _response_start(self, status: int, content_type: str) -> None:
        try:
            self._received_all()
        except Exception:
            self._failed("request")  # the body's end, read late: a request stage failure
        if status >= 400:
            return
        media = content_type.split(";", 1)[0].strip().lower()
        if media == "text/event-stream":
            self._resp = EventScan(self)
        elif media == "application/json" or media.endswith("+json"):
            self._resp = UsageScan()

    def _response_body(self, chunk: bytes, more: bool) -> None:
        resp = self._resp
        held, self._resp_held = self._resp_held, None
        if held is not None and resp is not None:
            if not more and not chunk:
                chunk = held  # the answer came in one piece, then its end
            else:
                resp.feed(held)
                self._resp_fed = True
        elif (more and not self._resp_fed and isinstance(resp, UsageScan)
              and 0 < len(chunk) <= WHOLE_LIMIT):
            self._resp_held = chunk
            return
        if resp is not None and chunk:
            if (not more and not self._resp_fed and isinstance(resp, UsageScan)
                    and len(chunk) <= WHOLE_LIMIT):
                resp.whole(chunk)
                self._resp = None  # read: nothing left to close
                self._usage = resp
            else:
                resp.feed(chunk)
            self._resp_fed = True

    def _read_end(self) -> None:
        """What the answer's end tells: the last held chunk, the tokens."""
        resp = self._resp
        held, self._resp_held = self._resp_held, None
        if held is not None and resp is not None:
            resp.feed(held)
        if resp is not None and self._complete:
            resp.close()
        if resp is None:
            resp = self._usage
        if resp is not None and (resp.prompt_tokens is not None
                                 or resp.completion_tokens is not None):
            self.tracker.tokens(resp.completion_tokens or 0, resp.prompt_tokens,
                                at=resp.last if isinstance(resp, EventScan) else None)

    def _final_status(self, client_left: bool) -> int:
        if self._complete and self._status is not None:
            resp = self._resp
            if isinstance(resp, EventScan) and resp.error:
                return max(self._status, _STATUS_FAILED)
            return self._status
        if client_left:
            return CLIENT_CLOSED
        return _STATUS_FAILED  # the server failed before its answer ended


#: When each stage's failure was last logged as a warning (``time.monotonic``).
_last_warning: dict[str, float] = {}
#: Seconds between warnings of one stage: a flood of crafted requests floods no log.
WARNING_EVERY_S = 60.0


def _log_failure(stage: str) -> None:
    """Log the exception being handled, as a warning with its traceback at most once a minute
    per stage, at debug otherwise."""
    now = monotonic()
    last = _last_warning.get(stage)
    if last is None or now - last >= WARNING_EVERY_S:
        _last_warning[stage] = now
        log.warning("the OpenAI meter failed reading an exchange (%s); the request goes on, "
                    "counted without the values this cost (mrc_meter_errors_total)", stage,
                    exc_info=True)
    else:
        log.debug("the OpenAI meter failed reading an exchange (%s)", stage, exc_info=True)


def metered(method: str, path: str, paths: Iterable[str] = METERED_PATHS) -> bool:
    """Whether a request is one the meter records (``POST`` to a path ending in one of
    ``paths``)."""
    return method == "POST" and path.endswith(tuple(paths))
