"""The image-structure walk, byte by byte: exact sizes, exact limits, exact refusals.

``tests/unit/test_preprocess_structure.py`` shows that crafted streams are refused and real
images pass; this file pins where each walker draws its lines, on streams built by hand with
``struct``. For every count (JPEG fill and stray bytes, markers and scans; PNG header, total and
compressed chunks; GIF extension blocks and stray bytes; TIFF directory entries and strip or tile
offsets) the stream at the limit passes and the stream one past it is refused with the message
naming the count, and counts add up over the whole stream rather than per run. Each walker reads
the size from exactly the bytes Pillow reads it from (unsigned fields, the right byte order and
offset, a length check that is exact at its edge), steps over the structures between (a GIF's
colour table and extension sub-blocks, an escaped JPEG 0xFF) to the next one and no further,
and stops with what it has where the structure stops (a trailer, a cut segment, an unknown
chunk), leaving the verdict to Pillow.
"""

from __future__ import annotations

import struct
import zlib

import pytest

from mrc_agent.exporters.imagewalk import Layout, StructureError, sniff, walk


def _refusal(fmt: str, limit: int, what: str) -> str:
    return (f"{fmt} has more than {limit} {what} (at most {limit} are accepted): "
            "a crafted or damaged image")


# -- JPEG ----------------------------------------------------------------------------------------

SOI = b"\xff\xd8"
EOI = b"\xff\xd9"
APP0 = b"\xff\xe0\x00\x02"  # an empty APP0 segment: a marker and its length
SCAN = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00\x00"  # an SOS segment and one byte of data


def _sof(width: int, height: int, length: int = 11) -> bytes:
    """An SOF0 segment of ``length`` bytes (7 holds the size and nothing after it)."""
    return (b"\xff\xc0" + struct.pack(">HBHH", length, 8, height, width)
            + b"\x01\x01\x11\x00"[:length - 7])


SOF = _sof(37, 23)
JPEG_FILL = _refusal("JPEG", 65536, "fill or stray bytes between its segments")
JPEG_MARKERS = _refusal("JPEG", 1024, "markers before its image data")
JPEG_SCANS = _refusal("JPEG", 256, "scans")

#: name -> (stream, the size the walk returns).
JPEG_SIZES: dict[str, tuple[bytes, tuple[int, int] | None]] = {
    "sof-right-after-soi-ending-the-stream": (SOI + SOF, (37, 23)),
    "sof-of-seven-bytes": (SOI + _sof(37, 23, 7), (37, 23)),
    "sof-over-32767-is-unsigned": (SOI + _sof(40000, 50000), (40000, 50000)),
    "no-sof": (SOI + EOI, None),
    "stray-bytes-then-sof-then-eoi": (SOI + APP0 + b"\x00\x01\x02" + SOF + EOI, (37, 23)),
    "escaped-ff-before-sof": (SOI + b"\xff\x00" + SOF, (37, 23)),
    "fill-bytes-to-the-end-after-sof": (SOI + SOF + b"\xff\xff", (37, 23)),
    "segment-length-1-stops-the-walk": (SOI + b"\xff\xe0\x00\x01" + SOF, None),
    "sof-running-past-the-end": (SOI + b"\xff\xc0\x00\x20\x08\x00\x17\x00\x25\x01\x01", None),
    "stray-bytes-at-the-limit": (SOI + APP0 + bytes(65536) + SOF, (37, 23)),
    "fill-bytes-at-the-limit": (SOI + b"\xff" * 65536 + SOF, (37, 23)),
    "markers-at-the-limit": (SOI + APP0 * 1023 + SOF, (37, 23)),
    "scans-at-the-limit": (SOI + SOF + SCAN * 256, (37, 23)),
}

#: name -> (stream, the refusal's message).
JPEG_REFUSED: dict[str, tuple[bytes, str]] = {
    "stray-bytes-one-past-the-limit": (SOI + APP0 + bytes(65537) + SOF, JPEG_FILL),
    "fill-bytes-one-past-the-limit": (SOI + b"\xff" * 65537 + SOF, JPEG_FILL),
    "stray-bytes-adding-up-over-two-runs":
        (SOI + APP0 + bytes(32769) + APP0 + bytes(32768) + SOF, JPEG_FILL),
    "fill-bytes-adding-up-over-two-runs":
        (SOI + b"\xff" * 32768 + APP0 + b"\xff" * 32769 + SOF, JPEG_FILL),
    "stray-and-fill-bytes-adding-up": (SOI + APP0 + bytes(32768) + b"\xff" * 32770 + SOF,
                                       JPEG_FILL),
    "markers-one-past-the-limit": (SOI + APP0 * 1024 + SOF, JPEG_MARKERS),
    "scans-one-past-the-limit": (SOI + SOF + SCAN * 257, JPEG_SCANS),
}


# -- PNG -----------------------------------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes = b"") -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def _ihdr(width: int = 37, height: int = 23) -> bytes:
    return _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))


IHDR = _ihdr()
IDAT = _chunk(b"IDAT", zlib.compress(b"\0" * 8))
IEND = _chunk(b"IEND")
OTHER = _chunk(b"abCD")  # an ancillary chunk Pillow steps over
#: The chunks Pillow inflates as it meets them, by turns.
COMPRESSED = [_chunk(b"iCCP", b"p\0\0x\x9c\x03\0\0\0\0\x01"), _chunk(b"zTXt", b"k\0\0x\x9c\x03\0"),
              _chunk(b"iTXt", b"k\0\x01\0\0\0x\x9c\x03\0")]


def _compressed(n: int) -> bytes:
    return b"".join(COMPRESSED[i % 3] for i in range(n))


PNG_HEADER = _refusal("PNG", 512, "chunks before its image data")
PNG_CHUNKS = _refusal("PNG", 65536, "chunks")
PNG_COMPRESSED = _refusal("PNG", 32, "compressed chunks (iCCP, zTXt, iTXt)")

PNG_SIZES: dict[str, tuple[bytes, tuple[int, int] | None]] = {
    "ihdr-alone-in-24-bytes": (PNG + struct.pack(">I4sII", 13, b"IHDR", 37, 23), (37, 23)),
    "size-over-2**31-is-unsigned": (PNG + _ihdr(2**31, 2**32 - 1) + IEND, (2**31, 2**32 - 1)),
    "first-chunk-not-ihdr": (PNG + _chunk(b"abCD", bytes(13)) + IEND, None),
    "header-chunks-at-the-limit": (PNG + IHDR + OTHER * 511 + IDAT + IEND, (37, 23)),
    "many-chunks-after-idat": (PNG + IHDR + IDAT + OTHER * 600 + IEND, (37, 23)),
    "many-chunks-after-fdat": (PNG + IHDR + _chunk(b"fdAT") + OTHER * 600 + IEND, (37, 23)),
    "many-chunks-after-iend": (PNG + IHDR + IEND + OTHER * 600, (37, 23)),
    "chunks-at-the-limit": (PNG + IHDR + IDAT + OTHER * 65533 + IEND, (37, 23)),
    "compressed-chunks-at-the-limit": (PNG + IHDR + _compressed(32) + IDAT + IEND, (37, 23)),
}

PNG_REFUSED: dict[str, tuple[bytes, str]] = {
    "header-chunks-one-past-the-limit": (PNG + IHDR + OTHER * 512 + IDAT + IEND, PNG_HEADER),
    "last-header-chunk-cut-after-its-name": (PNG + IHDR + OTHER * 511 + OTHER[:8], PNG_HEADER),
    "chunks-one-past-the-limit": (PNG + IHDR + IDAT + OTHER * 65534 + IEND, PNG_CHUNKS),
    "compressed-chunks-one-past-the-limit":
        (PNG + IHDR + _compressed(33) + IDAT + IEND, PNG_COMPRESSED),
}


# -- GIF -----------------------------------------------------------------------------------------


def _gif(flags: int = 0, table: bytes = b"") -> bytes:
    """A GIF89a header of an 8 x 8 screen, and the global colour table ``flags`` announce."""
    return b"GIF89a" + struct.pack("<HHBBB", 8, 8, flags, 0, 0) + table


#: An image descriptor past the 8 x 8 screen: Pillow widens the canvas to 50 x 40.
DESCRIPTOR = b"," + struct.pack("<HHHHB", 0, 0, 50, 40, 0)
#: A comment extension in two sub-blocks, the last data byte of which is a trailer's byte.
COMMENT = b"!\xfe\x02de\x03ab;\x00"
GIF_BLOCKS = _refusal("GIF", 16384, "extension blocks before its first image")
GIF_STRAY = _refusal("GIF", 65536, "stray bytes between its blocks")

GIF_SIZES: dict[str, tuple[bytes, tuple[int, int] | None]] = {
    "header-alone-in-13-bytes": (_gif(), (8, 8)),
    "trailer-before-any-image": (_gif() + b";" + DESCRIPTOR, (8, 8)),
    # Colour tables of trailer bytes: reading one as a block would end the walk at the screen.
    "colour-table-of-2-entries": (_gif(0x80, b";" * 6) + DESCRIPTOR + b";", (50, 40)),
    "colour-table-of-4-entries": (_gif(0x81, b";" * 12) + DESCRIPTOR + b";", (50, 40)),
    "colour-table-of-256-entries": (_gif(0x87, b";" * 768) + DESCRIPTOR + b";", (50, 40)),
    "table-size-bits-without-a-table": (_gif(0x01) + DESCRIPTOR + b";", (50, 40)),
    "comment-then-image": (_gif() + COMMENT + DESCRIPTOR + b";", (50, 40)),
    "extension-cut-after-a-sub-block": (_gif() + b"!\xfe\x01a", (8, 8)),
    "descriptor-cut-short": (_gif() + DESCRIPTOR[:8], (8, 8)),
    "descriptor-of-nine-bytes-ending-the-stream": (_gif() + DESCRIPTOR[:9], (50, 40)),
    "stray-bytes-then-image": (_gif() + b"\x01\x02\x03" + DESCRIPTOR + b";", (50, 40)),
    "stray-bytes-to-the-end": (_gif() + b"\x01\x02", (8, 8)),
    "stray-bytes-at-the-limit": (_gif() + b"\x01" * 65536 + DESCRIPTOR + b";", (50, 40)),
    "blocks-at-the-limit":
        (_gif() + b"!\xfe" + b"\x01a" * 16384 + b"\0" + DESCRIPTOR + b";", (50, 40)),
}

GIF_REFUSED: dict[str, tuple[bytes, str]] = {
    "stray-bytes-one-past-the-limit": (_gif() + b"\x01" * 65537 + DESCRIPTOR, GIF_STRAY),
    "stray-bytes-adding-up-over-two-runs":
        (_gif() + b"\x01" * 32769 + b"!\xfe\0" + b"\x01" * 32768 + DESCRIPTOR, GIF_STRAY),
    "blocks-one-past-the-limit":
        (_gif() + b"!\xfe" + b"\x01a" * 16385 + b"\0" + DESCRIPTOR, GIF_BLOCKS),
    "blocks-adding-up-over-two-extensions":
        (_gif() + (b"!\xfe" + b"\x01a" * 8193 + b"\0") * 2 + DESCRIPTOR, GIF_BLOCKS),
}


# -- WebP and BMP --------------------------------------------------------------------------------


def _riff(kind: bytes, payload: bytes) -> bytes:
    """A WebP whose first chunk is ``kind``; ``payload`` starts at byte 20."""
    chunk = kind + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def _bmp(info: bytes) -> bytes:
    """A BMP file header, then the DIB header ``info`` (its first 4 bytes: its own size)."""
    return b"BM" + struct.pack("<IHHI", 14 + len(info), 0, 0, 14 + len(info)) + info


VP8L_37x23 = (36 | 22 << 14).to_bytes(4, "little")

WEBP_BMP_SIZES: dict[str, tuple[bytes, Layout]] = {
    "webp-vp8x": (_riff(b"VP8X", bytes(4) + (36).to_bytes(3, "little")
                        + (22).to_bytes(3, "little")), Layout("WEBP", (37, 23))),
    "webp-vp8-scale-bits-masked": (_riff(b"VP8 ", b"\0\0\0\x9d\x01\x2a" + struct.pack(
        "<HH", 37 | 0xC000, 23 | 0x4000) + bytes(4)), Layout("WEBP", (37, 23))),
    "webp-vp8l": (_riff(b"VP8L", b"\x2f" + VP8L_37x23 + bytes(9)), Layout("WEBP", (37, 23))),
    "webp-other-chunk-holding-a-vp8-start-code": (_riff(b"ALPH", b"\0\0\0\x9d\x01\x2a"
                                                        + struct.pack("<HH", 37, 23)
                                                        + bytes(4)), Layout("WEBP", None)),
    "webp-other-chunk-holding-a-vp8l-signature": (_riff(b"ALPH", b"\x2f" + VP8L_37x23
                                                        + bytes(9)), Layout("WEBP", None)),
    "bmp-core-header-in-26-bytes": (_bmp(struct.pack("<IHHHH", 12, 40000, 300, 1, 24)),
                                    Layout("BMP", (40000, 300))),
    "bmp-info-header-stored-top-down": (_bmp(struct.pack("<IiiHHIIiiII", 40, 37, -23, 1, 24,
                                                         0, 0, 0, 0, 0, 0)),
                                        Layout("BMP", (37, 23))),
    "bmp-header-of-unknown-size": (_bmp(struct.pack("<IHHHH", 13, 37, 23, 1, 24)),
                                   Layout("BMP", None)),
}


@pytest.mark.parametrize("name", list(WEBP_BMP_SIZES))
def test_webp_and_bmp_sizes_come_from_their_fixed_headers_alone(name: str) -> None:
    data, layout = WEBP_BMP_SIZES[name]
    assert walk(data) == layout


# -- TIFF ----------------------------------------------------------------------------------------

Entry = tuple[int, int, int, int]  # tag, field type, count of values, value (or offset)
WIDTH: Entry = (256, 3, 1, 37)  # ImageWidth, SHORT
HEIGHT: Entry = (257, 4, 1, 23)  # ImageLength, LONG


def _tiff(entries: list[Entry], *, order: str = "<", big: bool = False,
          count: int | None = None) -> bytes:
    """A TIFF (``big``: BigTIFF) whose first directory, right after the header, holds
    ``entries`` and claims ``count`` of them; a single value sits in the entry's last field."""
    n = len(entries) if count is None else count
    fmt = {3: "H", 4: "I", 16: "Q"}
    if big:
        head = (b"II+\0" if order == "<" else b"MM\0+") + struct.pack(order + "HHQ", 8, 0, 16)
        ifd = struct.pack(order + "Q", n) + b"".join(
            struct.pack(order + "HHQ", tag, kind, values)
            + struct.pack(order + fmt.get(kind, "Q"), value).ljust(8, b"\0")
            for tag, kind, values, value in entries)
    else:
        head = (b"II*\0" if order == "<" else b"MM\0*") + struct.pack(order + "I", 8)
        ifd = struct.pack(order + "H", n) + b"".join(
            struct.pack(order + "HHI", tag, kind, values)
            + struct.pack(order + fmt.get(kind, "I"), value).ljust(4, b"\0")
            for tag, kind, values, value in entries)
    return head + ifd


FILLER: Entry = (258, 3, 1, 8)  # BitsPerSample
TIFF_ENTRIES = _refusal("TIFF", 1024, "entries in its first directory")
TIFF_STRIPS = _refusal("TIFF", 65536, "strips or tiles")

TIFF_SIZES: dict[str, tuple[bytes, tuple[int, int] | None]] = {
    "little-endian": (_tiff([WIDTH, HEIGHT]), (37, 23)),
    "big-endian": (_tiff([WIDTH, HEIGHT], order=">"), (37, 23)),
    "bigtiff-little-endian": (_tiff([(256, 16, 1, 37), HEIGHT], big=True), (37, 23)),
    "bigtiff-big-endian": (_tiff([(256, 16, 1, 37), HEIGHT], order=">", big=True), (37, 23)),
    "header-alone": (b"II*\0", None),
    "directory-claiming-more-entries-than-it-holds": (_tiff([WIDTH, HEIGHT], count=10), (37, 23)),
    "entries-at-the-limit": (_tiff([WIDTH, HEIGHT] + [FILLER] * 1022), (37, 23)),
    "strip-offsets-at-the-limit": (_tiff([WIDTH, HEIGHT, (273, 4, 65536, 0)]), (37, 23)),
    "many-values-of-another-tag": (_tiff([WIDTH, HEIGHT, (279, 4, 70000, 0)]), (37, 23)),
    "width-of-two-values": (_tiff([(256, 3, 2, 37), HEIGHT]), None),
    "width-as-a-rational": (_tiff([(256, 5, 1, 8), HEIGHT]), None),
    "width-alone": (_tiff([WIDTH]), None),
    "height-alone": (_tiff([HEIGHT]), None),
    # Offsets with the top bit set are past the end, not counted back from it (where a count
    # over the limit waits).
    "directory-offset-2**32-16": (b"II*\0" + struct.pack("<IH", 2**32 - 16, 1025) + bytes(14),
                                  None),
    "bigtiff-directory-offset-2**64-16":
        (b"II+\0" + struct.pack("<HHQQ", 8, 0, 2**64 - 16, 1025) + bytes(8), None),
}

TIFF_REFUSED: dict[str, tuple[bytes, str]] = {
    "entries-one-past-the-limit": (_tiff([WIDTH, HEIGHT] + [FILLER] * 1023), TIFF_ENTRIES),
    "entry-count-ending-the-stream": (_tiff([], count=1025), TIFF_ENTRIES),
    "bigtiff-entry-count-2**63": (_tiff([], big=True, count=2**63), TIFF_ENTRIES),
    # 16 bytes is enough to be walked: offset 0 reads the header itself as the entry count.
    "bigtiff-of-16-bytes": (b"II+\0" + struct.pack("<HHQ", 8, 0, 0), TIFF_ENTRIES),
    "strip-offsets-one-past-the-limit": (_tiff([WIDTH, HEIGHT, (273, 4, 65537, 0)]),
                                         TIFF_STRIPS),
    "tile-offsets-one-past-the-limit": (_tiff([WIDTH, HEIGHT, (324, 4, 65537, 0)]),
                                        TIFF_STRIPS),
    "strip-offsets-2**31": (_tiff([WIDTH, HEIGHT, (273, 4, 2**31, 0)]), TIFF_STRIPS),
    "bigtiff-strip-offsets-2**63": (_tiff([HEIGHT, (273, 16, 2**63, 0)], big=True),
                                    TIFF_STRIPS),
}


# -- sniffing and the walk's own handling -------------------------------------------------------


def test_a_riff_file_that_is_not_webp_is_no_allowed_format() -> None:
    avi = b"RIFF" + struct.pack("<I", 22) + b"AVI " + bytes(18)
    assert sniff(avi) is None
    assert walk(avi) is None
    assert sniff(b"RIFF\0\0\0\0WEBP") == "WEBP"


def test_a_read_past_the_end_gives_the_format_and_no_size() -> None:
    layout = walk(b"MM\0*\0\0")  # the directory offset cut after two of its four bytes
    assert layout == Layout("TIFF", None)
    assert layout is not None and layout.size is None


@pytest.mark.parametrize("data", [SOI + SOF, PNG + IHDR + IEND, _gif() + DESCRIPTOR,
                                  _tiff([WIDTH, HEIGHT])], ids=["jpeg", "png", "gif", "tiff"])
def test_on_size_hears_the_size_the_walk_returns_and_its_refusal_stops_the_walk(
        data: bytes) -> None:
    heard: list[tuple[int, int]] = []
    layout = walk(data, lambda w, h: heard.append((w, h)))
    assert layout is not None and heard[-1] == layout.size

    def refuse(width: int, height: int) -> None:
        raise OverflowError(width, height)

    with pytest.raises(OverflowError):
        walk(data, refuse)


#: Each format's tables of sizes read (JPEG: from the SOF segment reached; PNG: IHDR, chunks
#: counted up to IEND; GIF: the screen widened to the first image; TIFF: single-integer width
#: and height of the first directory) and of streams one past a count.
SIZES = {f"{fmt.lower()}-{name}": (fmt, case) for fmt, table in (
    ("JPEG", JPEG_SIZES), ("PNG", PNG_SIZES), ("GIF", GIF_SIZES), ("TIFF", TIFF_SIZES))
    for name, case in table.items()}
REFUSED = {f"{fmt}-{name}": case for fmt, table in (
    ("jpeg", JPEG_REFUSED), ("png", PNG_REFUSED), ("gif", GIF_REFUSED), ("tiff", TIFF_REFUSED))
    for name, case in table.items()}


@pytest.mark.parametrize("name", list(SIZES))
def test_each_format_walk_reads_the_size_where_its_structure_puts_it(name: str) -> None:
    fmt, (data, size) = SIZES[name]
    assert walk(data) == Layout(fmt, size)


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_stream_one_past_a_count_is_refused_naming_that_count(name: str) -> None:
    data, message = REFUSED[name]
    with pytest.raises(StructureError) as ei:
        walk(data)
    assert str(ei.value) == message
