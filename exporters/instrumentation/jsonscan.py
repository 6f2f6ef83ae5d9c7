"""An incremental JSON scanner with bounded state: a few values read from a body as it streams by.

The OpenAI meter (:mod:`mrc_agent.exporters.instrumentation.meter`) must know a request's prompt
length, its images and whether it streams, and a response's ``usage``, without holding the body
(it passes through, to the app or the upstream, which keeps its own copy) and without letting a
hostile body cost more than a fixed amount per byte. So this is not a parser that builds values:
it walks the bytes once, keeps a stack of container keys, and for each scalar it meets asks its
owner (:meth:`JsonScanner.mode`) what to do with it:

* ``SKIP`` — nothing (the default: most of a body, base64 images included, is skipped with
  ``re.search`` over the string, which runs in C);
* ``COUNT`` — count the string's characters as Python's ``len`` counts what ``json.loads``
  makes of it (UTF-8 continuation bytes are not characters; an escape is one; a surrogate pair
  of escapes is one);
* ``CAPTURE`` — keep the decoded string up to ``capture_limit`` bytes, and say whether it was cut.

Its state between chunks is the container stack (at most ``max_depth`` deep), the value being
read, and at most a few bytes of an escape or literal cut by a chunk boundary. Past ``max_depth``
(100,000 nested brackets), past ``max_tokens`` scalars and brackets (a million-element array) or
at a byte that cannot be JSON, it stops and sets :attr:`JsonScanner.failed`: the rest passes
unread, and the owner treats what it wanted as unknown. The scanner is permissive: it tracks
structure, it does not validate grammar (the server that receives the body does).
"""

from __future__ import annotations

import re
from json.decoder import scanstring  # type: ignore[attr-defined]

SKIP, COUNT, CAPTURE = 0, 1, 2

#: A path element for an array's item (object members are their key, decoded, as ``str``).
ITEM = None
#: Nesting deeper than this is no real request (a chat request nests six deep).
MAX_DEPTH = 64
#: Scalars and brackets scanned before giving up (a chat request has a few hundred).
MAX_TOKENS = 100_000
#: Bytes of an object key kept (longer keys are none the meter looks for).
_KEY_LIMIT = 64

_TOKEN = re.compile(rb"[ \t\r\n]*(?:([{}\[\]:,])|(\")|([^ \t\r\n{}\[\]:,\"]+))")
#: UTF-8 continuation bytes: removing them leaves one byte per code point.
_CONTINUATION = bytes(range(0x80, 0xC0))
#: A surrogate no UTF-8 can carry: one from a ``\\uD800``-``\\uDFFF`` escape left unpaired
#: (surrogateescape's own, U+DC80-U+DCFF, stand for undecodable bytes and are kept as them).
_LONE_SURROGATE = re.compile("[\ud800-\udc7f\udd00-\udfff]")
#: A literal (number, true, false, null) longer than this is cut: no value the meter reads needs
#: more, and a chunk boundary inside one carries at most this much.
_LITERAL_LIMIT = 32
#: Bytes of a string with escapes read in one go at first (doubling after): a short string's
#: window stays short, a long one's grows to its length in a few steps.
_FIRST_WINDOW = 256


class JsonScanner:
    """Feed it chunks (:meth:`feed`), then :meth:`close`; override :meth:`mode`,
    :meth:`string` and :meth:`literal` to receive the values wanted.

    ``path`` arguments are tuples of keys (``str``) and :data:`ITEM` for array items, from the
    root: ``("messages", ITEM, "content")``.
    """

    capture_limit = 4096

    def __init__(self) -> None:
        #: Why scanning stopped early, or None.
        self.failed: str | None = None
        self._keys: list[str | None] = []   # path: one entry per open container
        self._is_obj: list[bool] = []
        self._expect_key = False
        self._carry = b""                    # an escape or literal cut by a chunk boundary
        self._in_string = False
        self._str_mode = SKIP
        self._str_is_key = False
        self._count = 0
        self._high = False  # the last character counted was a \u escape of a high surrogate
        self._window = _FIRST_WINDOW  # bytes the next read of a string with escapes takes
        self._buf = bytearray()
        self._cut = False
        self._tokens = 0
        self._done = False

    # --- the owner's hooks ------------------------------------------------------------------

    def mode(self, path: tuple[str | None, ...]) -> int:
        """What to do with the string value at ``path``: SKIP, COUNT or CAPTURE."""
        return SKIP

    def string(self, path: tuple[str | None, ...], value: bytes | int, cut: bool) -> None:
        """A string value asked for: its character count (COUNT) or bytes (CAPTURE)."""

    def literal(self, path: tuple[str | None, ...], text: bytes) -> None:
        """A number, ``true``, ``false`` or ``null`` at ``path`` (cut at 32 bytes)."""

    # --- feeding ----------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> None:
        """Read the next bytes of the body."""
        if self.failed is not None or self._done or not chunk:
            return
        if self._carry:
            chunk = self._carry + chunk
            self._carry = b""
        pos, end = 0, len(chunk)
        while pos < end and self.failed is None:
            if self._in_string:
                pos = self._string_part(chunk, pos, end)
                continue
            m = _TOKEN.match(chunk, pos)
            if m is None:  # only whitespace left
                return
            self._tokens += 1
            if self._tokens > MAX_TOKENS:
                self.failed = f"more than {MAX_TOKENS} values"
                return
            if m.lastindex == 1:
                self._structural(chunk[m.start(1)])
                pos = m.end()
            elif m.lastindex == 2:
                self._start_string()
                pos = m.end()
            else:
                if m.end() == end:  # may continue in the next chunk
                    self._carry = chunk[m.start(3):end][:_LITERAL_LIMIT + 1]
                    self._tokens -= 1
                    return
                self._literal(chunk[m.start(3):m.end()])
                pos = m.end()

    def close(self) -> None:
        """The body ended: a literal waiting for its end is complete; an open string or
        container is not, and a body of no value at all is no JSON. A second close does
        nothing."""
        if self._done:
            return
        carried = bool(self._carry) and not self._in_string
        if self.failed is None and carried:
            carry, self._carry = self._carry, b""
            self._literal(carry)
        if self.failed is None and (self._in_string or self._keys):
            self.failed = "the body ended inside a value"
        elif self.failed is None and not self._tokens and not carried:
            self.failed = "no JSON value in the body"
        self._done = True

    # --- structure --------------------------------------------------------------------------

    def _path(self) -> tuple[str | None, ...]:
        return tuple(self._keys)

    def _structural(self, c: int) -> None:
        if c in (0x7B, 0x5B):  # { [
            if len(self._keys) >= MAX_DEPTH:
                self.failed = f"nested more than {MAX_DEPTH} deep"
                return
            obj = c == 0x7B
            self._keys.append(ITEM)
            self._is_obj.append(obj)
            self._expect_key = obj
        elif c in (0x7D, 0x5D):  # } ]
            if not self._keys:
                self.failed = "a closing bracket with nothing open"
                return
            self._keys.pop()
            self._is_obj.pop()
            self._expect_key = False
            if not self._keys:
                self._done = True
        elif c == 0x2C and self._is_obj and self._is_obj[-1]:  # , in an object
            self._expect_key = True
            self._keys[-1] = ITEM
        # ':' needs nothing: the key was set when its string ended.

    def _literal(self, text: bytes) -> None:
        if self._expect_key or not self._keys and self._tokens > 1:
            self.failed = "a bare word where JSON has none"
            return
        self.literal(self._path(), text[:_LITERAL_LIMIT])

    def _start_string(self) -> None:
        self._in_string = True
        self._count = 0
        self._high = False
        self._window = _FIRST_WINDOW
        self._cut = False
        self._buf.clear()
        if self._keys and self._is_obj[-1] and self._expect_key:
            self._str_is_key = True
            self._str_mode = CAPTURE
        else:
            self._str_is_key = False
            self._str_mode = self.mode(self._path())

    def _end_string(self) -> None:
        self._in_string = False
        if self._str_is_key:
            key = None if self._cut else self._buf.decode("utf-8", "replace")
            self._keys[-1] = key if key is not None else "\x00"
            self._expect_key = False
        elif self._str_mode == COUNT:
            self.string(self._path(), self._count, False)
        elif self._str_mode == CAPTURE:
            self.string(self._path(), bytes(self._buf), self._cut)

    # --- strings ----------------------------------------------------------------------------

    def _take(self, data: bytes, start: int, stop: int) -> None:
        mode = self._str_mode
        if mode == COUNT:
            self._count += len(data[start:stop].translate(None, _CONTINUATION))
            self._high = False
        elif mode == CAPTURE:
            limit = _KEY_LIMIT if self._str_is_key else self.capture_limit
            room = limit - len(self._buf)
            if stop - start > room:
                self._cut = True
                stop = start + max(room, 0)
            if stop > start:
                self._buf += data[start:stop]

    def _string_part(self, data: bytes, pos: int, end: int) -> int:
        # Two memchr passes (bytes.find), not a pattern: a 20 MB base64 string is skipped at
        # memory speed. The backslash is looked for only up to the closing quote.
        quote = data.find(b'"', pos, end)
        stop = data.find(b"\\", pos, end if quote < 0 else quote)
        if stop >= 0:
            return self._escaped_part(data, pos, end)
        if quote < 0:
            if self._str_mode != SKIP:
                self._take(data, pos, end)
            return end
        if quote > pos and self._str_mode != SKIP:
            self._take(data, pos, quote)
        self._end_string()
        return quote + 1

    def _escaped_part(self, data: bytes, pos: int, end: int) -> int:
        # The rest of a string that holds escapes, read by the json module's C string scanner
        # (a Python step per escape cost 200 times a plain byte) over windows that double from
        # _FIRST_WINDOW bytes: a short string costs a short window, a long one a few windows,
        # and no byte is scanned twice (a search for the end ahead of the scan would run to
        # the chunk's end for each string, and the scan again to read it).
        window = self._window
        while True:
            stop = min(end, pos + window)
            raw = data[pos:stop]
            cut = _escape_boundary(raw)
            # latin-1: one character per byte, so positions in the text are positions in the
            # bytes; the escapes, all ASCII, read the same.
            text = raw[:cut].decode("latin-1")
            try:
                value, after = scanstring(text + '"', 0, False)
            except ValueError as e:
                self.failed = ("a \\u escape without four hex digits" if "uXXXX" in str(e)
                               else "an unknown escape in a string")
                return end
            closed = after <= len(text)  # at a quote of its own, not the one added
            if after > 1:
                self._decoded(raw[:after - 1] if closed else raw[:cut], value)
            if closed:
                self._end_string()
                return pos + after
            if stop == end:
                if cut < len(raw):  # an escape cut by the chunk's end waits for the next one
                    self._carry = raw[cut:]
                return end
            pos += cut
            window *= 2
            self._window = window  # a long string: its next chunk starts with a long window

    def _decoded(self, raw: bytes, value: str) -> None:
        """Count or capture ``raw``, a run of a string's bytes holding escapes, whole, that
        ``scanstring`` read (byte for character) as ``value``."""
        mode = self._str_mode
        if mode == COUNT:
            # Characters as the plain path counts them (UTF-8 lead bytes), less what the
            # escapes saved: each is one character (a surrogate pair of them one in all).
            plain = len(raw) if raw.isascii() else len(raw.translate(None, _CONTINUATION))
            n = plain - (len(raw) - len(value))
            if (self._high and raw.startswith(b"\\u") and value
                    and 0xDC00 <= ord(value[0]) <= 0xDFFF):
                n -= 1  # the low half of a pair whose high half ended the last part
            self._count += n
            self._high = bool(value) and 0xD800 <= ord(value[-1]) <= 0xDBFF
        elif mode == CAPTURE and (self._str_is_key or len(self._buf) < self.capture_limit):
            if not raw.isascii():
                # Bytes and escapes decoded both as UTF-8 (latin-1 could not tell them apart).
                value, _ = scanstring(raw.decode("utf-8", "surrogateescape") + '"', 0, False)
            # A lone surrogate escape becomes U+FFFD; an undecodable byte stays that byte.
            data = _LONE_SURROGATE.sub("\ufffd", value).encode("utf-8", "surrogateescape")
            self._take(data, 0, len(data))
        elif mode == CAPTURE:
            self._cut = True


def _escape_boundary(raw: bytes) -> int:
    """How many of ``raw``'s bytes (which start on an escape's boundary) end on one: all but
    an escape cut short at the end (a last backslash, or ``\\u`` and fewer than 4 digits)."""
    n = len(raw)
    run = n - len(raw.rstrip(b"\\"))
    if run % 2:
        return n - 1
    if run:
        return n
    u = raw.rfind(b"\\u", max(0, n - 5))
    if u < 0:
        return n
    head = raw[:u + 1]
    # Only a backslash left over from pairing escapes the u: an odd run ending there.
    return u if (len(head) - len(head.rstrip(b"\\"))) % 2 else n
