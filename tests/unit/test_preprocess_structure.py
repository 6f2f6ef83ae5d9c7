"""Crafted image headers cost milliseconds: the structure walk that runs before Pillow.

Each crafted stream here is one that Pillow's own openers walk a byte, a block or a chunk at a
time in Python (seconds for 19 MB). The walk refuses it by count, as a damaged image (422),
before Pillow reads a byte; real images of every allowed format pass unchanged, with the size
Pillow reads; and a header claiming more pixels than the limit is refused before Pillow
allocates anything (WebP's decoder allocates its canvas as it opens).
"""

from __future__ import annotations

import io
import struct
import time
import zlib
from collections.abc import Callable

import pytest
from PIL import Image

from mrc_agent.exporters import imagewalk as structure
from mrc_agent.reference_service import preprocess as P
from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.settings import Settings

#: Just under the service's default 20 MiB limit: what an attacker sends.
BIG = 19 * 1024 * 1024


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


_PNG = b"\x89PNG\r\n\x1a\n"
_IHDR = _chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 0, 0, 0, 0))
_IDAT = _chunk(b"IDAT", zlib.compress(b"\0" * 72))
_IEND = _chunk(b"IEND", b"")
_GIF = b"GIF89a" + struct.pack("<HHBBB", 8, 8, 0x80, 0, 0) + bytes(6)
#: SOI, an 8x8 one-component frame header, and empty scans: libjpeg passes over the whole frame
#: once per scan, whatever the scan holds.
_JPEG_FRAME = b"\xff\xd8\xff\xc0\x00\x0b\x08\x00\x08\x00\x08\x01\x01\x11\x00"
_JPEG_SCAN = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00\x00"
_GIF_FRAME = b",\0\0\0\0\x08\0\x08\0\0\x02\x02\x44\x01\0;"


def _tiff_strips(n: int, height: int = 1000) -> bytes:
    """A 1 x ``height`` grey TIFF, one row per strip, listing ``n`` strip offsets."""
    def entry(tag: int, typ: int, count: int, value: int) -> bytes:
        return struct.pack("<HHII", tag, typ, count, value)
    data = 8 + 2 + 12 * 8 + 4
    entries = [entry(256, 4, 1, 1), entry(257, 4, 1, height), entry(258, 3, 1, 8),
               entry(259, 3, 1, 1), entry(262, 3, 1, 1), entry(273, 4, n, data),
               entry(278, 4, 1, 1), entry(279, 4, n, data + 4 * n)]
    ifd = struct.pack("<H", len(entries)) + b"".join(entries) + b"\0\0\0\0"
    return (b"II*\0" + struct.pack("<I", 8) + ifd + struct.pack(f"<{n}I", *[data] * n)
            + struct.pack(f"<{n}I", *[1] * n))


def _tiff_tags(n: int) -> bytes:
    """A classic TIFF whose first directory has ``n`` entries."""
    tags = [struct.pack("<HHII", 256 + i % 65000, 3, 1, 1) for i in range(n)]
    return b"II*\0" + struct.pack("<I", 8) + struct.pack("<H", n) + b"".join(tags) + bytes(4)


#: name -> (crafted stream, what the refusal names). Seconds of Pillow each, before the walk.
CRAFTED: dict[str, tuple[Callable[[], bytes], str]] = {
    "jpeg-fill-bytes": (lambda: b"\xff\xd8" + b"\xff" * BIG, "fill"),
    "jpeg-junk-bytes": (lambda: b"\xff\xd8\xff\xe0\x00\x04JF" + b"\x00" * BIG, "fill"),
    "jpeg-empty-segments": (lambda: b"\xff\xd8" + b"\xff\xe0\x00\x02" * (BIG // 4), "markers"),
    "jpeg-bare-markers": (lambda: b"\xff\xd8" + b"\xff\xd0" * (BIG // 2), "markers"),
    "jpeg-many-scans": (lambda: _JPEG_FRAME + _JPEG_SCAN * (BIG // len(_JPEG_SCAN)), "scans"),
    "png-empty-chunks": (lambda: _PNG + _IHDR + _chunk(b"abCD", b"") * (BIG // 12) + _IDAT
                         + _IEND, "chunks"),
    "png-chunks-after-idat": (lambda: _PNG + _IHDR + _IDAT + _chunk(b"abCD", b"")
                              * (BIG // 12) + _IEND, "chunks"),
    "png-empty-idats": (lambda: _PNG + _IHDR + _IDAT + _chunk(b"IDAT", b"") * (BIG // 12)
                        + _IEND, "chunks"),
    "png-inflating-profiles": (lambda: _PNG + _IHDR + _chunk(
        b"iCCP", b"x\0\0" + zlib.compress(b"\0" * (1 << 20), 9)) * (BIG // 1060) + _IDAT
        + _IEND, "compressed"),
    "gif-comment-blocks": (lambda: _GIF + b"!\xfe" + b"\x01a" * (BIG // 2) + b"\0"
                           + _GIF_FRAME, "blocks"),
    "gif-junk-bytes": (lambda: _GIF + b"\x01" * BIG + _GIF_FRAME, "stray"),
    "tiff-strip-offsets": (lambda: _tiff_strips(BIG // 8), "strips"),
    "tiff-directory-entries": (lambda: _tiff_tags(65535), "entries"),
    "bigtiff-directory-entries": (lambda: b"II+\0" + struct.pack("<HHQQ", 8, 0, 16, 1 << 40)
                                  + bytes(BIG), "entries"),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_header_is_refused_by_count_before_pillow(name: str) -> None:
    build, names = CRAFTED[name]
    data = build()
    assert len(data) <= Settings().max_image_bytes
    with pytest.raises(ServiceError) as ei:
        P.probe(data, Settings())
    e = ei.value
    assert (e.status, e.code) == (422, "image_corrupt"), e
    assert names in e.message and "at most" in e.message, e.message


def test_the_walk_costs_milliseconds_not_seconds() -> None:
    """Not a timing goal (those live in benchmarks): a ceiling 100x above what the walk takes
    on an idle core, far below the seconds Pillow spent on the same bytes."""
    streams = [build() for build, _ in CRAFTED.values()]
    t0 = time.process_time()
    for data in streams:
        with pytest.raises(structure.StructureError):
            structure.walk(data)
    assert time.process_time() - t0 < 5.0


# -- real images pass, with the size Pillow reads --------------------------------------------


def _real(fmt: str, mode: str = "RGB", size: tuple[int, int] = (37, 23), **kw: object) -> bytes:
    img = Image.new(mode, size, (200, 100, 50) if mode == "RGB" else 128)
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _animated(fmt: str) -> bytes:
    frames = [Image.new("RGB", (37, 23), (i * 40, 0, 0)) for i in range(4)]
    buf = io.BytesIO()
    frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], duration=50, loop=0,
                   **({"comment": b"a comment"} if fmt == "GIF" else {}))
    return buf.getvalue()


def _exif_icc_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    exif[0x010E] = "x" * 5000
    return _real("JPEG", exif=exif.tobytes(), icc_profile=b"\0" * 200_000, progressive=True)


REAL: dict[str, Callable[[], bytes]] = {
    "jpeg": lambda: _real("JPEG"),
    "jpeg-progressive-exif-icc": _exif_icc_jpeg,
    "jpeg-restart-markers": lambda: _real("JPEG", size=(400, 300), restart_marker_blocks=1),
    "png": lambda: _real("PNG"),
    "png-grey-text": lambda: _real("PNG", "L", pnginfo=_pnginfo()),
    "png-animated": lambda: _animated("PNG"),
    "gif": lambda: _real("GIF"),
    "gif-animated-comment": lambda: _animated("GIF"),
    "webp-lossy": lambda: _real("WEBP"),
    "webp-lossless": lambda: _real("WEBP", lossless=True),
    "webp-alpha": lambda: _real("WEBP", "RGBA"),
    "webp-animated": lambda: _animated("WEBP"),
    "bmp": lambda: _real("BMP"),
    "tiff": lambda: _real("TIFF"),
    "tiff-strips": lambda: _real("TIFF", size=(300, 200), compression="tiff_lzw"),
    "tiff-big-endian": lambda: _big_endian_tiff(),
    "bigtiff": lambda: _real("TIFF", big_tiff=True),
}


def _pnginfo() -> object:
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for i in range(20):
        info.add_text(f"k{i}", "v" * 100, zip=i % 2 == 0)
    return info


def _big_endian_tiff() -> bytes:
    buf = io.BytesIO()
    Image.new("I;16B", (37, 23)).save(buf, "TIFF")  # Pillow writes this mode as "MM"
    return buf.getvalue()


@pytest.mark.parametrize("name", list(REAL))
def test_real_images_pass_with_the_size_pillow_reads(name: str) -> None:
    data = REAL[name]()
    with Image.open(io.BytesIO(data)) as img:
        expected = img.size
    layout = structure.walk(data)
    assert layout is not None and layout.size == expected, layout
    assert P.probe(data, Settings())[1:] == expected


# -- the pixel limit applies before Pillow ---------------------------------------------------


def _webp_vp8x(w: int, h: int) -> bytes:
    body = b"\x10\0\0\0" + (w - 1).to_bytes(3, "little") + (h - 1).to_bytes(3, "little")
    vp8x = b"VP8X" + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x


HUGE: dict[str, bytes] = {
    "webp-canvas": _webp_vp8x(16000, 16000),
    "gif-screen": b"GIF89a" + struct.pack("<HHBBB", 65535, 65535, 0, 0, 0) + _GIF_FRAME,
    "gif-frame-past-the-screen": b"GIF89a" + struct.pack("<HHBBB", 8, 8, 0, 0, 0)
    + b"," + struct.pack("<HHHHB", 0, 0, 65535, 65535, 0) + b"\x02\x02\x44\x01\0;",
    "bmp": b"BM" + struct.pack("<IHHI", 0, 0, 0, 54) + struct.pack(
        "<IiiHHIIiiII", 40, 60000, -60000, 1, 24, 0, 0, 0, 0, 0, 0),
    "tiff": _tiff_strips(1, height=60000).replace(struct.pack("<HHII", 256, 4, 1, 1),
                                                  struct.pack("<HHII", 256, 4, 1, 60000)),
}


@pytest.mark.parametrize("name", list(HUGE))
def test_a_header_over_the_pixel_limit_is_refused_before_pillow(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pillow(*args: object, **kw: object) -> None:
        raise AssertionError("Pillow was handed a header the walk could refuse")

    monkeypatch.setattr(Image, "open", no_pillow)
    with pytest.raises(ServiceError) as ei:
        P.probe(HUGE[name], Settings())
    assert (ei.value.status, ei.value.code) == (413, "decompression_bomb"), ei.value
    assert "50000000-pixel limit" in ei.value.message
