"""The incremental JSON scanner on its own: what it hands its owner, compared with what
``json.loads`` makes of the same body however the body is cut into chunks, and where it stops.

The meter's tests (test_meter*.py) read it through the OpenAI scans; these drive its hooks
directly: every path it reports, string counts and captures across chunk and window
boundaries (the escaped-string reader takes 256 bytes, then doubling windows), the capture
and key limits to the byte, and each limit (depth, values, literal length) at its edge.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mrc_agent.exporters.instrumentation import jsonscan
from mrc_agent.exporters.instrumentation.jsonscan import (
    CAPTURE,
    COUNT,
    ITEM,
    MAX_DEPTH,
    MAX_TOKENS,
    SKIP,
    JsonScanner,
)

Path = tuple[str | None, ...]
Event = tuple[Any, ...]

#: The escaped-string reader's first window, in bytes (``jsonscan._FIRST_WINDOW``).
WINDOW = 256


class Rec(JsonScanner):
    """Records every hook call; ``want`` gives the mode of a path (SKIP if absent), or
    ``every`` the mode of every string value."""

    def __init__(self, want: dict[Path, int] | None = None, every: int | None = None,
                 limit: int | None = None) -> None:
        super().__init__()
        self.want = want or {}
        self.every = every
        if limit is not None:
            self.capture_limit = limit
        self.asked: list[Path] = []
        self.got: list[Event] = []

    def mode(self, path: Path) -> int:
        self.asked.append(path)
        return self.every if self.every is not None else self.want.get(path, SKIP)

    def string(self, path: Path, value: bytes | int, cut: bool) -> None:
        self.got.append(("s", path, value, cut))

    def literal(self, path: Path, text: bytes) -> None:
        self.got.append(("l", path, text))


def scan(chunks: list[bytes], *, close: bool = True, **kw: Any) -> Rec:
    r = Rec(**kw)
    for c in chunks:
        r.feed(c)
    if close:
        r.close()
    return r


def cuttings(raw: bytes, every: bool = True) -> Iterator[list[bytes]]:
    """The body whole, cut in two at each byte (or a spread of cuts), a byte at a time, and in
    a few random pieces."""
    yield [raw]
    cuts = range(1, len(raw)) if every else sorted({*range(1, len(raw), 37), len(raw) - 1})
    for cut in cuts:
        yield [raw[:cut], raw[cut:]]
    yield [raw[i:i + 1] for i in range(len(raw))]
    rng = random.Random(len(raw))
    for _ in range(3):
        points = sorted(rng.sample(range(1, len(raw)), min(6, len(raw) - 1)))
        yield [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]


def expected(value: Any, string: Callable[[Path, str], Event | None],
             path: Path = ()) -> Iterator[Event]:
    """The hook calls a scan of ``json.dumps(value)`` makes, in order."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from expected(v, string, (*path, k))
    elif isinstance(value, list):
        for v in value:
            yield from expected(v, string, (*path, ITEM))
    elif isinstance(value, str):
        event = string(path, value)
        if event is not None:
            yield event
    else:
        yield ("l", path, json.dumps(value).encode()[:32])


def counted(path: Path, value: str) -> Event:
    return ("s", path, len(value), False)


def captured(path: Path, value: str) -> Event:
    return ("s", path, value.encode(), False)


def string_paths(value: Any, path: Path = ()) -> Iterator[Path]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from string_paths(v, (*path, k))
    elif isinstance(value, list):
        for v in value:
            yield from string_paths(v, (*path, ITEM))
    elif isinstance(value, str):
        yield path


# --- structure: paths and literals ------------------------------------------------------------


DOC: Any = {
    "model": "m", "stream": False, "n": None, "t": 0.25, "big": -12e-3,
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi \"there\"\n"},
                                     {"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "assistant", "content": "ok", "tool_calls": []},
    ],
    "k\u00e9y\n": {"": [1, [2, [True, {}], []], {"x": [[]]}, 3]},
    "empty": {}, "list": [{}, 1, "s", {"a": 1}, 2],
    "after": 7,
}


@pytest.mark.parametrize("dumps", [
    {}, {"indent": 1}, {"separators": (",", ":")}, {"ensure_ascii": False, "indent": "\t"},
], ids=["spaced", "indented", "compact", "tabs"])
def test_every_path_and_literal_is_the_documents_whatever_the_chunking(
        dumps: dict[str, Any]) -> None:
    text = json.dumps(DOC, **dumps)
    raw = text.replace("\n", "\r\n").encode() if "indent" in dumps else text.encode()
    want_count = list(expected(DOC, counted))
    want_capture = list(expected(DOC, captured))
    want_asked = list(string_paths(DOC))
    for chunks in cuttings(raw):
        r = scan(chunks, every=COUNT)
        assert (r.failed, r.got) == (None, want_count), chunks
        assert r.asked == want_asked
        r = scan(chunks, every=CAPTURE)
        assert (r.failed, r.got) == (None, want_capture), chunks


def test_only_the_strings_asked_for_are_reported_and_keys_are_never_asked() -> None:
    raw = json.dumps(DOC).encode()
    text = ("messages", ITEM, "content", ITEM, "text")
    url = ("messages", ITEM, "content", ITEM, "image_url", "url")
    r = scan([raw], want={text: COUNT, url: CAPTURE, ("model",): SKIP})
    literals = [e for e in expected(DOC, lambda p, v: None)]
    assert r.failed is None
    assert [e for e in r.got if e[0] == "s"] == [("s", text, 11, False), ("s", url, b"u", False)]
    assert [e for e in r.got if e[0] == "l"] == literals
    assert r.asked == list(string_paths(DOC))
    assert ("messages", None, "content", None, "text") in r.asked  # an item is None


def test_the_default_hooks_skip_every_string() -> None:
    class Literals(JsonScanner):
        def __init__(self) -> None:
            super().__init__()
            self.got: list[Event] = []

        def string(self, path: Path, value: bytes | int, cut: bool) -> None:
            self.got.append(("s", path, value, cut))

        def literal(self, path: Path, text: bytes) -> None:
            self.got.append(("l", path, text))

    s = Literals()
    s.feed(json.dumps(DOC).encode())
    s.close()
    assert s.failed is None
    assert s.got == list(expected(DOC, lambda p, v: None))
    assert JsonScanner().mode(("model",)) == SKIP
    plain = JsonScanner()
    plain.feed(b'{"a": "b\\n", "c": [1, true]}')
    plain.close()
    assert plain.failed is None


@pytest.mark.parametrize("body", [b"42", b"-1.5e3", b"true", b"null", b"  7"])
def test_a_literal_alone_is_the_body_read_at_its_end(body: bytes) -> None:
    for chunks in cuttings(body):
        r = scan(chunks)
        assert (r.failed, r.got) == (None, [("l", (), body.strip())]), chunks
        # the body may go on: a literal at a chunk's end waits for the next chunk or close()
        assert scan(chunks, close=False).got == []
    for chunks in cuttings(body + b"\r\n"):
        r = scan(chunks, close=False)
        assert (r.failed, r.got) == (None, [("l", (), body.strip())]), chunks


def test_a_string_alone_is_the_body() -> None:
    for chunks in cuttings(b' "a\\tb\xc3\xa9" '):
        assert scan(chunks, every=COUNT).got == [("s", (), 4, False)], chunks
        assert scan(chunks, every=CAPTURE).got == [("s", (), "a\tb\u00e9".encode(), False)]


def test_a_literal_is_cut_at_32_bytes_wherever_the_chunks_end() -> None:
    digits = b"1234567890" * 5  # 50 digits, no two neighbours alike
    for lit in (digits[:31], digits[:32], digits[:33], digits[:34], digits):
        for chunks in cuttings(b'{"a": [' + lit + b"]}"):
            r = scan(chunks)
            assert (r.failed, r.got) == (None, [("l", ("a", ITEM), lit[:32])]), chunks
        for chunks in cuttings(lit):  # the body's last bytes: the literal ends with close()
            r = scan(chunks)
            assert (r.failed, r.got) == (None, [("l", (), lit[:32])]), chunks


def test_a_literal_after_a_closed_container_in_an_array_is_a_value() -> None:
    for body in (b"[{}, 1]", b"[[], 1]", b'{"a": [{"b": {}}, 2], "c": 3}', b"[{},{}, [1]]"):
        want = list(expected(json.loads(body), counted))
        for chunks in cuttings(body):
            r = scan(chunks, every=COUNT)
            assert (r.failed, r.got) == (None, want), chunks


@pytest.mark.parametrize("body", [b"{1: 2}", b'{"a": 1, 2: 3}', b'{"a": {true: 1}}', b"5 6 "])
def test_a_bare_word_where_json_has_none_stops_the_scan(body: bytes) -> None:
    for chunks in cuttings(body):
        r = scan(chunks)
        assert r.failed == "a bare word where JSON has none", chunks


@pytest.mark.parametrize("body", [b"{} 5 ", b"[] true]", b'"a" 1 ', b"[1]\n2,"])
def test_a_bare_word_after_the_document_in_its_chunk_stops_the_scan(body: bytes) -> None:
    r = scan([body])
    assert r.failed == "a bare word where JSON has none"


def test_a_key_of_64_bytes_is_kept_and_a_longer_one_is_no_key() -> None:
    for key in ("k" * 63, "k" * 64, "\u00e9" * 32, "\n" * 64, "a\\" * 32, "k" * 63 + "\n"):
        body = json.dumps({key: 1, "b": 2}).encode()
        for chunks in cuttings(body, every=False):
            r = scan(chunks)
            assert (r.failed, r.got) == (None, [("l", (key,), b"1"), ("l", ("b",), b"2")]), key
    for key in ("k" * 65, "\u00e9" * 32 + "k", "\n" * 65, "k" * 64 + "\n", "\n" + "k" * 400):
        body = json.dumps({key: 1, "b": {key: "v"}}).encode()
        for chunks in cuttings(body, every=False):
            r = scan(chunks, every=COUNT)
            assert r.failed is None
            assert r.got == [("l", ("\x00",), b"1"), ("s", ("b", "\x00"), 1, False)], key


def test_keys_with_escapes_do_not_depend_on_the_capture_limit() -> None:
    doc = {"ab\ncd\nef\ngh": 1, "\u00e9\t\u00e8": 2, "x": {"\"q\"\\": 3}}
    want = list(expected(doc, counted))
    for ascii_only in (True, False):
        body = json.dumps(doc, ensure_ascii=ascii_only).encode()
        for chunks in cuttings(body):
            r = scan(chunks, every=COUNT, limit=3)
            assert (r.failed, r.got) == (None, want), chunks


def test_a_key_of_bytes_that_are_not_utf8_reads_as_replacement_characters() -> None:
    for body in (b'{"a\xffb": 1}', b'{"a\xff\\nb": 1}'):
        key = "a\ufffdb" if b"\\n" not in body else "a\ufffd\nb"
        for chunks in cuttings(body):
            assert scan(chunks).got == [("l", (key,), b"1")], chunks


# --- where a scan stops -------------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    opening = b"".join(b'{"k": ' if i % 2 else b"[" for i in range(depth))
    closing = b"".join(b"}" if i % 2 else b"]" for i in reversed(range(depth)))
    return opening + b"1" + closing


def test_nesting_is_allowed_to_max_depth_and_not_one_deeper() -> None:
    assert MAX_DEPTH == 64
    path = tuple("k" if i % 2 else ITEM for i in range(MAX_DEPTH))
    for chunks in ([_nested(MAX_DEPTH)], [_nested(MAX_DEPTH)[:100], _nested(MAX_DEPTH)[100:]]):
        r = scan(chunks)
        assert (r.failed, r.got) == (None, [("l", path, b"1")])
    for chunks in ([_nested(MAX_DEPTH + 1)], [b"[" * (MAX_DEPTH + 1)]):
        r = scan(chunks)
        assert r.failed == f"nested more than {MAX_DEPTH} deep" and r.got == []


def _values(n: int) -> bytes:
    """A body of exactly ``n`` scalars and brackets (n >= 4)."""
    if n % 2:  # [ + (1,) * k + 1 ]: 2k + 3
        return b"[" + b"1," * ((n - 3) // 2) + b"1]"
    return b"[" + b"1," * ((n - 4) // 2) + b"[]]"  # 2k + 4


def test_the_value_limit_counts_each_value_once_however_the_chunks_cut_them() -> None:
    assert MAX_TOKENS == 100_000
    for piece in (1 << 30, 7):
        for n, ok in ((MAX_TOKENS, True), (MAX_TOKENS + 1, False)):
            body = _values(n)
            r = JsonScanner()
            for i in range(0, len(body), piece):
                r.feed(body[i:i + piece])
            r.close()
            want = None if ok else f"more than {MAX_TOKENS} values"
            assert r.failed == want, (piece, n)


def test_the_value_limit_counts_strings_and_literals_alike() -> None:
    k = (MAX_TOKENS - 4) // 2
    r = scan([b"[" + b'"s",' * k + b"[]]"])  # 2k + 4 values
    assert r.failed is None and r.got == []
    r = scan([b"[" + b'"s",' * (k + 1) + b"1]"])  # 2k + 5
    assert r.failed == f"more than {MAX_TOKENS} values"


def test_nothing_is_read_after_a_failure() -> None:
    r = Rec(every=COUNT)
    r.feed(b'[1, "a", ]]')
    assert r.failed == "a closing bracket with nothing open"
    got = list(r.got)
    r.feed(b'[1, "x"]')
    r.feed(b"[" * 100)
    r.close()
    assert r.failed == "a closing bracket with nothing open" and r.got == got
    r = Rec()
    r.feed(b'{"a": "\\q", "b": 1}')
    assert r.failed == "an unknown escape in a string" and r.got == []
    r.feed(b'"c": 2}')
    r.close()
    assert r.failed == "an unknown escape in a string" and r.got == []


def test_nothing_is_read_after_the_document_or_the_body_ends() -> None:
    r = Rec(every=COUNT)
    r.feed(b'{"a": 1}')
    r.feed(b']] 5 {"b": "x"}')
    r.close()
    assert (r.failed, r.got) == (None, [("l", ("a",), b"1")])
    r = Rec(every=COUNT)
    r.feed(b'{"a": 1,')
    r.close()
    assert r.failed == "the body ended inside a value"
    r = Rec(every=COUNT)
    r.feed(b"12")
    r.close()
    r.feed(b"34")
    r.feed(b"]")
    r.close()
    assert (r.failed, r.got) == (None, [("l", (), b"12")])
    r = Rec(every=COUNT)
    r.feed(b"")
    r.feed(b'["a"]')
    r.feed(b"")
    r.close()
    assert (r.failed, r.got) == (None, [("s", (ITEM,), 1, False)])


def test_an_empty_chunk_between_the_pieces_of_a_literal_changes_nothing() -> None:
    r = Rec()
    for c in (b"[12", b"", b"34", b"", b"]"):
        r.feed(c)
    r.close()
    assert (r.failed, r.got) == (None, [("l", (ITEM,), b"1234")])


@pytest.mark.parametrize("body", [
    b'"abc', b'{"a": "x\\', b'{"a": "x\\u12', b'["\\n', b'{"a": {} ', b"[", b'{"a":', b'{"a',
])
def test_a_body_that_ends_inside_a_value_is_unfinished(body: bytes) -> None:
    for chunks in cuttings(body):
        r = scan(chunks, every=CAPTURE)
        assert r.failed == "the body ended inside a value", chunks
        assert r.got == []


def test_a_second_close_changes_nothing() -> None:
    for body in (b"12", b'{"a": 1}', b'"s"', b'{"a": "b'):
        r = scan([body], every=CAPTURE)
        got, failed = list(r.got), r.failed
        r.close()
        r.feed(b"3")
        r.close()
        assert (r.failed, r.got) == (failed, got), body


def test_a_complete_body_closes_clean() -> None:
    for body in (b"{}", b"[]", b'{"a": [1, "b"]}  ', b'"s"', b"\n[]\n"):
        for chunks in cuttings(body):
            r = scan(chunks)
            assert r.failed is None, chunks


# --- strings: counts --------------------------------------------------------------------------


STRINGS = [
    "", "a", "abc", "\u00e9", "\u0400", "\u00c0\u0100", "\u20ac", "\U0001f600", "\U0001d11e",
    "\U00010000", "\U0010ffff", "a\U0001f600b\u00e9", "\\", "\\\\", "\\\\\\", '"', '\\"',
    '\\\\"', "/", "\\u1234", "\\\\u12", "a\\u", "\x00\x01\x1f", "\t\n\r\b\f", "x\n" * 3,
    "\u00e9\n\"\t", "\\\n", "\U0001f600\U0001f600", "\u00e9\U0001f600",
    "\\u\u1234", "\\\\u\u00e9", "\\\u1234", "a\\u12\\u",
]
#: Lone surrogates: only ``\\u`` escapes carry them (json.dumps with ensure_ascii).
SURROGATES = [
    "\ud800", "\udc00", "\udbff", "\udfff", "\ud83d", "\ude00", "\ud800\ue000", "\ue000",
    "\udc00\udc00", "a\u00e9\udc00", "abc\udc00", "\ud83dx\ude00", "\ud83d\ud83d\ude00",
    "\ud800\U00010000", "\ud83d\ude00\ude00", "\udbff\udbff\udfff", "\udfff\udc00",
]


@pytest.mark.parametrize("ascii_only", [True, False], ids=["escaped", "utf8"])
def test_a_count_is_len_of_the_decoded_string_however_the_chunks_cut_it(
        ascii_only: bool) -> None:
    for s in STRINGS + (SURROGATES if ascii_only else []):
        # what follows in the body (non-ASCII bytes too) is no part of the count
        body = json.dumps({"t": s, "n": 1, "z": "\u00e9\U0001f600"},
                          ensure_ascii=ascii_only).encode()
        for chunks in cuttings(body):
            r = scan(chunks, want={("t",): COUNT})
            n = len(json.loads(body)["t"])  # a pair of surrogate escapes is one character
            assert (r.failed, r.got) == (None, [("s", ("t",), n, False),
                                                 ("l", ("n",), b"1")]), (s, chunks)


def test_a_count_stops_at_the_closing_quote_whatever_follows_it() -> None:
    # The scanner does not check grammar: bytes after a string are read as a bare word.
    for value in (b"a\\n", b"\\u00e9x", b"\xc3\xa9\\t", b"abc"):
        want = len(json.loads(b'"' + value + b'"'))
        for after in (b"\x80\x80", b"\xbf", b"\xc3\xa9"):
            body = b'["' + value + b'"' + after + b"]"
            for chunks in cuttings(body):
                r = scan(chunks, every=COUNT)
                assert r.got == [("s", (ITEM,), want, False), ("l", (ITEM,), after)], chunks


def test_a_pair_split_across_chunks_is_one_character_only_when_it_is_a_pair() -> None:
    for s in SURROGATES + ["\U0001f600", "\U00010000", "\U0010ffff", "\ud800\ue000"]:
        body = json.dumps([s]).encode()
        # cut after each escape: the next piece starts with a \u escape
        for i in range(len(body)):
            if body.startswith(b"\\u", i):
                r = scan([body[:i], body[i:]], every=COUNT)
                assert r.got == [("s", (ITEM,), len(json.loads(body)[0]), False)], (s, i)


def test_bytes_that_are_not_utf8_count_one_each_and_continuation_bytes_none() -> None:
    cases = [(b"\xc0", 1), (b"\xc1", 1), (b"\xff\xfe", 2), (b"\x80", 0), (b"\xbf", 0),
             (b"a\xc0\x80b", 3), (b"\xd0\x80", 1), (b"\xf0\x9f\x98\x80", 1)]
    for raw, n in cases:
        for tail in (b"", b"\\n"):  # the plain reader, and the escaped one
            body = b'{"t": "' + raw + tail + b'"}'
            for chunks in cuttings(body):
                r = scan(chunks, every=COUNT)
                assert r.got == [("s", ("t",), n + len(tail) // 2, False)], (body, chunks)


def test_raw_control_characters_beside_escapes_are_read_not_refused() -> None:
    for value in (b"a\tb\\nc", b"\x01\\\"\x1f", b"\xc3\xa9\x00\\t\n"):
        body = b'["' + value + b'"]'
        want = json.loads(body.decode(), strict=False)[0]
        for chunks in cuttings(body):
            r = scan(chunks, every=COUNT)
            assert (r.failed, r.got) == (None, [("s", (ITEM,), len(want), False)]), chunks
            r = scan(chunks, every=CAPTURE)
            assert (r.failed, r.got) == (None, [("s", (ITEM,), want.encode(), False)]), chunks


def _long_strings() -> Iterator[str]:
    """Strings whose escapes sit across the reader's window boundaries (256, 768, 1792 bytes
    of the string's text with the doubling)."""
    for edge in (WINDOW, 3 * WINDOW, 7 * WINDOW):
        for k in range(edge - 8, edge + 3):
            yield "\n" + "a" * (k - 2)           # ends near an edge
            yield "\n" + "a" * (k - 2) + "b"
            yield "\n" + "a" * (k - 2) + "\u00e9xyz"     # \u00e9 across the edge
            yield "\n" + "a" * (k - 2) + "\\\\\\yz"      # \\ \\ \\ across it
            yield "\n" + "a" * (k - 2) + "\U0001f600z"   # a surrogate pair across it
            yield "\n" + "a" * (k - 2) + '\n"z'


def test_long_strings_with_escapes_count_across_windows() -> None:
    strings = list(_long_strings())
    for s in strings:
        for prefix in ("", "xy"):
            body = json.dumps({"t": prefix + s, "u": "tail\n"}).encode()
            for piece in (1 << 20, 300, 100):
                chunks = [body[i:i + piece] for i in range(0, len(body), piece)]
                r = scan(chunks, every=COUNT)
                assert r.failed is None
                assert r.got == [("s", ("t",), len(prefix + s), False),
                                 ("s", ("u",), 5, False)], (s, piece)


def test_a_string_starting_with_an_escape_cut_by_the_chunk_reads_whole() -> None:
    for s in ("\u1234", "\n", "\\", "\\u", "\U0001f600", "\\\\\\u1234"):
        body = json.dumps([s, s]).encode()
        want = [("s", (ITEM,), len(s), False)] * 2
        for chunks in cuttings(body):
            assert scan(chunks, every=COUNT).got == want, chunks
            if not _pair_escaped(s):
                assert scan(chunks, every=CAPTURE).got == [("s", (ITEM,), s.encode(), False)] * 2


def test_the_escaped_reader_takes_windows_that_double_from_256_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    scan_string = jsonscan.scanstring

    def recorded(text: str, end: int, strict: bool) -> tuple[str, int]:
        sizes.append(len(text) - 1)  # less the quote the reader adds
        return scan_string(text, end, strict)  # type: ignore[no-any-return]

    monkeypatch.setattr(jsonscan, "scanstring", recorded)
    value = "\n" + "a" * 5000
    r = scan([json.dumps([value, "\t"]).encode()], every=COUNT)
    assert r.got == [("s", (ITEM,), len(value), False), ("s", (ITEM,), 1, False)]
    # 256, 512, 1024, 2048 bytes, then the rest of the body; the next string starts anew
    assert sizes[:4] == [256, 512, 1024, 2048] and len(sizes) == 6
    assert sizes[5] == len(b'\\t"]')


# --- strings: captures ------------------------------------------------------------------------


def _pair_escaped(s: str) -> bool:
    return any(ord(c) > 0xFFFF for c in s)


@pytest.mark.parametrize("ascii_only", [True, False], ids=["escaped", "utf8"])
def test_a_capture_is_the_decoded_string_however_the_chunks_cut_it(ascii_only: bool) -> None:
    for s in STRINGS:
        if ascii_only and _pair_escaped(s):
            continue  # a pair of escapes cut between its halves is captured as two U+FFFD
        body = json.dumps({"t": s, "n": [s]}, ensure_ascii=ascii_only).encode()
        for chunks in cuttings(body):
            r = scan(chunks, want={("t",): CAPTURE})
            assert (r.failed, r.got) == (None, [("s", ("t",), s.encode(), False)]), chunks


def test_a_capture_keeps_bytes_that_are_not_utf8_as_they_came() -> None:
    for raw, want in ((b"a\xffb", b"a\xffb"), (b"a\xff\\nb", b"a\xff\nb"),
                      (b"\xc3\xa9\xfe\\t", b"\xc3\xa9\xfe\t"), (b"\\n\xc3", b"\n\xc3")):
        body = b'{"t": "' + raw + b'"}'
        for chunks in cuttings(body):
            r = scan(chunks, every=CAPTURE)
            assert (r.failed, r.got) == (None, [("s", ("t",), want, False)]), chunks


def test_a_lone_surrogate_escape_is_captured_as_a_replacement_character() -> None:
    rep = "\ufffd".encode()
    for s, want in (("\ud800", rep), ("\udfff", rep), ("a\udbffb", b"a" + rep + b"b"),
                    ("\ud83d\ude00", "\U0001f600".encode()),
                    ("\u00e9\ud800", "\u00e9".encode() + rep)):
        body = json.dumps([s]).encode()
        for raw in (body, body.replace(b"[", "[\"\u00e8\\t\", ".encode(), 1)):
            r = scan([raw], every=CAPTURE)
            assert r.failed is None and r.got[-1] == ("s", (ITEM,), want, False), s
        nonascii = b'["\xc3\xa8' + json.dumps(s)[1:-1].encode() + b'"]'  # é, then escapes
        r = scan([nonascii], every=CAPTURE)
        assert r.got == [("s", (ITEM,), "\u00e8".encode() + want, False)], s


@pytest.mark.parametrize("start", [0, 1, 5, 40])
def test_a_capture_stops_at_its_limit_to_the_byte(start: int) -> None:
    # A plain string and one with escapes, the limit around the value's length and around the
    # reader's window; whole, in two pieces, and in pieces of 7 bytes.
    values = ["x" * 20 + "\u00e9" * 3, "\n" + "x" * 300 + "\u00e9\t" * 3,
              "\n" + "a" * 254, "\n" + "a" * 254 + "b", "\n" + "a" * 255 + '"' * 3,
              "\u00e9" * 200]
    for value in values:
        data = value.encode()
        body = json.dumps({"p": "p" * start, "v": value}, ensure_ascii=False).encode()
        at = body.index(b'"v": "') + 6  # the value's first byte
        limits = {0, 1, 2, 19, 20, 21, 22, 23, 26, 254, 255, 256, 257, 300, 301,
                  len(data) - 1, len(data), len(data) + 1, 4096}
        for limit in sorted(limits):
            want = [("s", ("v",), data[:limit], len(data) > limit)]
            # the second piece starting where the limit is reached (exactly, for a plain value)
            for chunks in ([body], [body[:start + 20], body[start + 20:]],
                           [body[:at + limit], body[at + limit:]],
                           [body[i:i + 7] for i in range(0, len(body), 7)]):
                r = scan(chunks, want={("v",): CAPTURE}, limit=limit)
                assert (r.failed, r.got) == (None, want), (value[:5], limit, chunks[:1])


def test_the_default_capture_limit_is_4096_bytes() -> None:
    assert JsonScanner.capture_limit == 4096
    for n, cut in ((4095, False), (4096, False), (4097, True)):
        for value in ("x" * n, "\n" + "x" * (n - 1)):
            r = scan([json.dumps([value]).encode()], every=CAPTURE)
            assert r.got == [("s", (ITEM,), value.encode()[:4096], cut)], (n, value[:1])


def test_a_capture_filled_exactly_by_one_window_is_not_cut_until_more_comes() -> None:
    # The first window takes 256 bytes of the string's text: "\\n" and 254 "a", 255 decoded.
    for tail, cut in (("", False), ("b", True), ("\n", True), ('"', True)):
        value = "\n" + "a" * 254 + tail
        body = json.dumps({"u": value}).encode()
        r = scan([body], every=CAPTURE, limit=255)
        assert r.got == [("s", ("u",), value.encode()[:255], cut)], tail
