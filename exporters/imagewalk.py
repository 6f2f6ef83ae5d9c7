"""Bounded walks of an image's container structure, before Pillow parses a byte of it.

Shared by the reference service (its header checks,
:mod:`mrc_agent.reference_service.preprocess.header`) and the OpenAI meter
(:mod:`mrc_agent.exporters.instrumentation.meter`, which reads an image's size from the first
bytes of a base64 upload); plain Python, no Pillow.

Pillow's openers walk some structures a byte, a block or a chunk at a time in Python, a few
microseconds a step. Of 19 MB streams (``tests/unit/test_preprocess_structure.py`` has each), JPEG
fill bytes took 5.5 s to open, 1.6 million empty PNG chunks 3.1 s, a thousand iCCP chunks that
each inflate to 1 MiB 10.6 s, 9.5 million GIF comment sub-blocks 1.8 s and 2.4 million TIFF
strip offsets 4.4 s; decoding a PNG walks every chunk after the image data the same way.

:func:`walk` follows the same structure first, with searches that run in C (``bytes.find``,
compiled patterns) over runs of bytes and one Python step per segment, chunk or block, and
counts. Past a count no real image needs, the walk raises :class:`StructureError` (the reference
service answers it as ``image_corrupt``, 422: a crafted or damaged image, whoever sent it), so a
crafted header costs milliseconds and Pillow never sees it. On the way it reads the width and
height and hands them to ``on_size`` at once, so the pixel limit applies before Pillow allocates
anything (WebP's decoder allocates its canvas as it opens) and before the rest of the stream is
walked.

Where the walk cannot follow the structure (a length past the end, a marker Pillow does not
know, a chunk name that is not one), it stops and returns what it has: Pillow's own walk stops
at the same place, having done no more steps than were counted, and says what is wrong in its
own words. The walk refuses only by count, never by a structure rule of its own, so a real image
Pillow opened before still opens; the limits below say why each is far above real images.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

#: JPEG: fill (0xFF) and stray bytes between the segments before the image data, which Pillow
#: steps over one at a time. Encoders write none, or a few to align a segment.
MAX_JPEG_PADDING = 64 * 1024
#: JPEG: markers before the image data. A photo has about a dozen; an ICC profile split over
#: APP2 segments adds at most 255 (its sequence number is one byte).
MAX_JPEG_MARKERS = 1024
#: JPEG: scans. A progressive encoder writes about ten (optimised scan scripts a few dozen);
#: libjpeg passes over every block of the frame once per scan, so thousands of near-empty scans
#: (end-of-band runs, a few bytes each) cost seconds of decoding.
MAX_JPEG_SCANS = 256
#: PNG: chunks before the image data (Pillow's header walk, one chunk at a time): IHDR, PLTE,
#: tRNS, colour and text chunks are a few dozen even in an image heavy with metadata.
MAX_PNG_HEADER_CHUNKS = 512
#: PNG: chunks in all, which decoding walks one at a time. Encoders split the image data into
#: 8-64 KiB IDAT chunks (a 20 MiB PNG: 320-2,560); even one per row of a 50 MP image is fewer
#: than 10,000.
MAX_PNG_CHUNKS = 65536
#: PNG: chunks Pillow inflates as it meets them (iCCP, zTXt, iTXt), up to 1 MiB each: an image
#: carries one profile and a few compressed texts.
MAX_PNG_COMPRESSED_CHUNKS = 32
#: GIF: data sub-blocks of the extensions before the first image (comments, application data
#: such as XMP, or an ICC profile at 255 bytes a block: 1 MiB is 4,112 blocks).
MAX_GIF_BLOCKS = 16384
#: GIF: stray bytes between blocks, which Pillow skips one at a time; encoders write none.
MAX_GIF_STRAY = 64 * 1024
#: TIFF: entries of the first directory, each parsed in Python: a few dozen are usual (a
#: GeoTIFF has about a hundred).
MAX_TIFF_ENTRIES = 1024
#: TIFF: strip or tile offsets, one Python tile each as Pillow opens the file. One row per strip
#: of a 50 MP image 8,000 pixels wide is 6,250 strips.
MAX_TIFF_STRIPS = 65536

#: Magic numbers of the allowed formats (BigTIFF included: Pillow opens it as TIFF).
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"II+\x00", "TIFF"),
    (b"MM\x00+", "TIFF"),
)

_FILL = re.compile(rb"\xff+")
#: Markers Pillow reads no length for (JPG, RSTn, SOI, EOI, JPGn); every other one it knows,
#: 0xC0-0xFE, has a length.
_JPEG_NO_LENGTH = frozenset({0xC8, *range(0xD0, 0xDA), *range(0xF0, 0xFE)})
#: Markers whose segment Pillow reads the frame size from (SOFn, and DHP with the same layout).
_JPEG_SOF = frozenset({*range(0xC0, 0xD0), 0xDE}) - {0xC4, 0xC8, 0xCC}
_JPEG_SOS = b"\xff\xda"
#: Pillow's test for a chunk name; it stops at the first chunk that fails it.
_PNG_NAME = re.compile(rb"\w\w\w\w")
_PNG_COMPRESSED = frozenset({b"iCCP", b"zTXt", b"iTXt"})
_GIF_BLOCK = re.compile(rb"[!,;]")
_TIFF_STRIPS = (273, 324)  # StripOffsets, TileOffsets
#: TIFF field types that can hold a width or height: SHORT, LONG, LONG8.
_TIFF_INTS = {3: "H", 4: "I", 16: "Q"}

SizeCheck = Callable[[int, int], None]


@dataclass(frozen=True)
class Layout:
    """What the walk found: the format and, when the header holds it, (width, height)."""

    format: str
    size: tuple[int, int] | None = None


def sniff(data: bytes) -> str | None:
    """The allowed format whose magic number ``data`` starts with, or None."""
    for magic, fmt in _MAGIC:
        if data.startswith(magic):
            return fmt
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


class StructureError(ValueError):
    """A stream whose structure goes past a count no real image reaches: crafted or damaged."""


def _too_many(fmt: str, what: str, limit: int) -> StructureError:
    return StructureError(f"{fmt} has more than {limit} {what} (at most "
                          f"{limit} are accepted): a crafted or damaged image")


def _no_check(width: int, height: int) -> None:
    return None


def walk(data: bytes, on_size: SizeCheck = _no_check) -> Layout | None:
    """Walk ``data``'s structure within the budgets above; None when no allowed format's magic
    number starts it. ``on_size(width, height)`` is called as soon as a size is read (it may
    raise to refuse the image). Raises :class:`StructureError` past a budget."""
    fmt = sniff(data)
    if fmt is None:
        return None
    walker = _WALKERS[fmt]
    try:
        size = walker(data, on_size)
    except (IndexError, struct.error):
        # A read past the end that a bounds check missed: the structure ends there, and so
        # does Pillow's walk; it gives the verdict.
        size = None
    return Layout(fmt, size)


def _jpeg(data: bytes, on_size: SizeCheck) -> tuple[int, int] | None:
    n = len(data)
    pos = 2  # at the 0xFF after SOI, where Pillow's marker loop starts
    padding = markers = 0
    size: tuple[int, int] | None = None
    while pos < n:
        if data[pos] != 0xFF:  # stray bytes up to the next 0xFF
            left = MAX_JPEG_PADDING - padding
            nxt = data.find(b"\xff", pos, pos + left + 1)
            padding += (nxt if nxt >= 0 else min(n, pos + left + 1)) - pos
            if padding > MAX_JPEG_PADDING:
                raise _too_many("JPEG", "fill or stray bytes between its segments",
                                MAX_JPEG_PADDING)
            if nxt < 0:
                return size
            pos = nxt
        run = _FILL.match(data, pos, pos + MAX_JPEG_PADDING - padding + 2)
        assert run is not None  # data[pos] is 0xFF
        padding += run.end() - pos - 1
        pos = run.end()
        if padding > MAX_JPEG_PADDING:
            raise _too_many("JPEG", "fill or stray bytes between its segments",
                            MAX_JPEG_PADDING)
        if pos >= n:
            return size
        marker = data[pos]
        pos += 1
        if marker == 0x00:  # an escaped 0xFF outside a scan: Pillow skips it
            continue
        if marker < 0xC0:  # not a marker: Pillow stops ("no marker found")
            return size
        markers += 1
        if markers > MAX_JPEG_MARKERS:
            raise _too_many("JPEG", "markers before its image data", MAX_JPEG_MARKERS)
        if marker in _JPEG_NO_LENGTH:
            continue
        if pos + 2 > n:
            return size
        length = int.from_bytes(data[pos:pos + 2], "big")
        if length < 2 or pos + length > n:
            return size
        if marker in _JPEG_SOF and length >= 7:
            height, width = struct.unpack_from(">HH", data, pos + 3)
            size = (width, height)
            on_size(width, height)
        elif marker == 0xDA:
            # In entropy-coded data every 0xFF is followed by 0x00 or a restart marker, so
            # each further FF DA starts a scan: counted in C.
            if data.count(_JPEG_SOS, pos) + 1 > MAX_JPEG_SCANS:
                raise _too_many("JPEG", "scans", MAX_JPEG_SCANS)
            return size
        pos += length
    return size


def _png(data: bytes, on_size: SizeCheck) -> tuple[int, int] | None:
    n = len(data)
    if n < 24 or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack_from(">II", data, 16)
    on_size(width, height)
    pos = 8
    chunks = compressed = 0
    header = True
    while pos + 8 <= n:
        name = data[pos + 4:pos + 8]
        if not _PNG_NAME.fullmatch(name):
            break
        chunks += 1
        if name in (b"IDAT", b"fdAT"):
            header = False
        elif header and chunks > MAX_PNG_HEADER_CHUNKS:
            raise _too_many("PNG", "chunks before its image data", MAX_PNG_HEADER_CHUNKS)
        if chunks > MAX_PNG_CHUNKS:
            raise _too_many("PNG", "chunks", MAX_PNG_CHUNKS)
        if name in _PNG_COMPRESSED:
            compressed += 1
            if compressed > MAX_PNG_COMPRESSED_CHUNKS:
                raise _too_many("PNG", "compressed chunks (iCCP, zTXt, iTXt)",
                                MAX_PNG_COMPRESSED_CHUNKS)
        if name == b"IEND":
            break
        pos += 12 + int.from_bytes(data[pos:pos + 4], "big")
    return width, height


def _gif(data: bytes, on_size: SizeCheck) -> tuple[int, int] | None:
    n = len(data)
    if n < 13:
        return None
    width, height = struct.unpack_from("<HH", data, 6)
    on_size(width, height)
    flags = data[10]
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    blocks = stray = 0
    while pos < n:
        kind = data[pos]
        if kind == 0x3B:  # trailer
            break
        if kind == 0x21:  # an extension: its label, then sub-blocks up to an empty one
            pos += 2
            while pos < n and data[pos]:
                blocks += 1
                if blocks > MAX_GIF_BLOCKS:
                    raise _too_many("GIF", "extension blocks before its first image",
                                    MAX_GIF_BLOCKS)
                pos += 1 + data[pos]
            pos += 1
            continue
        if kind == 0x2C:  # the first image: Pillow widens the canvas to hold it, and stops
            if pos + 9 <= n:
                x0, y0, w, h = struct.unpack_from("<HHHH", data, pos + 1)
                width, height = max(width, x0 + w), max(height, y0 + h)
                on_size(width, height)
            break
        left = MAX_GIF_STRAY - stray
        found = _GIF_BLOCK.search(data, pos, pos + left + 1)
        stray += (found.start() if found else min(n, pos + left + 1)) - pos
        if stray > MAX_GIF_STRAY:
            raise _too_many("GIF", "stray bytes between its blocks", MAX_GIF_STRAY)
        if found is None:
            break
        pos = found.start()
    return width, height


def _webp(data: bytes, on_size: SizeCheck) -> tuple[int, int] | None:
    # libwebp parses the chunks in C; only the size matters here, from the first chunk.
    if len(data) < 30:
        return None
    kind = data[12:16]
    if kind == b"VP8X":
        size = (1 + int.from_bytes(data[24:27], "little"),
                1 + int.from_bytes(data[27:30], "little"))
    elif kind == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack_from("<HH", data, 26)
        size = (w & 0x3FFF, h & 0x3FFF)
    elif kind == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        size = ((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    else:
        return None
    on_size(*size)
    return size


def _bmp(data: bytes, on_size: SizeCheck) -> tuple[int, int] | None:
    # A fixed header, and a palette Pillow itself caps at 65,536 entries.
    if len(data) < 26:
        return None
    header = int.from_bytes(data[14:18], "little")
    if header == 12:
        width, height = struct.unpack_from("<HH", data, 18)
    elif header >= 40:
        width, height = struct.unpack_from("<ii", data, 18)
        height = abs(height)  # negative: stored top-down
    else:
        return None
    on_size(width, height)
    return width, height


def _tiff(data: bytes, on_size: SizeCheck) -> tuple[int, int] | None:
    # Only the first directory: Pillow opens that one and reads the chain no further.
    order = "<" if data[:2] == b"II" else ">"
    big = data[2:4] in (b"+\x00", b"\x00+")
    n = len(data)
    if big:
        if n < 16:
            return None
        (ifd,) = struct.unpack_from(order + "Q", data, 8)
        head, entry_size, entry_fmt = 8, 20, order + "HHQ"
    else:
        (ifd,) = struct.unpack_from(order + "I", data, 4)
        head, entry_size, entry_fmt = 2, 12, order + "HHI"
    if ifd + head > n:
        return None
    (count,) = struct.unpack_from(order + ("Q" if big else "H"), data, ifd)
    if count > MAX_TIFF_ENTRIES:
        raise _too_many("TIFF", "entries in its first directory", MAX_TIFF_ENTRIES)
    scalars: dict[int, int] = {}
    start = ifd + head
    for i in range(min(count, (n - start) // entry_size)):
        at = start + i * entry_size
        tag, kind, values = struct.unpack_from(entry_fmt, data, at)
        if tag in _TIFF_STRIPS and values > MAX_TIFF_STRIPS:
            raise _too_many("TIFF", "strips or tiles", MAX_TIFF_STRIPS)
        if tag in (256, 257) and values == 1 and kind in _TIFF_INTS:
            # A single value sits in the entry's last field (4 bytes, BigTIFF 8).
            value_at = at + (12 if big else 8)
            scalars[tag] = struct.unpack_from(order + _TIFF_INTS[kind], data, value_at)[0]
    if 256 not in scalars or 257 not in scalars:
        return None
    size = (scalars[256], scalars[257])
    on_size(*size)
    return size


_WALKERS: dict[str, Callable[[bytes, SizeCheck], tuple[int, int] | None]] = {
    "JPEG": _jpeg, "PNG": _png, "GIF": _gif, "WEBP": _webp, "BMP": _bmp, "TIFF": _tiff,
}
