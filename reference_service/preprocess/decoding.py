"""Decoding on the CPU, shared by both resize paths: header checks, draft-mode decode, RGB.

:func:`_decode` starts from the header checks of
:mod:`~mrc_agent.reference_service.preprocess.header`, then decodes. A JPEG is decoded in draft mode
— libjpeg scales by 1/2, 1/4 or 1/8 inside the IDCT, so it never builds the full-resolution picture
— at the smallest scale whose output still covers both the model's input size and the OCR size;
other formats are decoded in full. Every colour mode ends as 8-bit RGB (transparency composited on
white).

EXIF orientation is honoured on every path in one way: targets are computed in the stored
orientation (:func:`_stored`), and the *small* results are transposed afterwards with
``_ORIENT_TRANSPOSE`` (cheaper than transposing a full photo, and identical to
``ImageOps.exif_transpose`` followed by a resize). The geometry helpers here are what the
decoder and both resize paths share.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from PIL import Image

from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.preprocess.header import _open
from mrc_agent.reference_service.settings import Settings

log = logging.getLogger(__name__)

_EXIF_ORIENTATION = 0x0112
#: EXIF orientation -> the transpose that displays the image upright (as ImageOps.exif_transpose).
_ORIENT_TRANSPOSE: dict[int, Image.Transpose] = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
#: Orientations whose upright picture has width and height swapped.
_SWAPS_AXES = frozenset({5, 6, 7, 8})


@dataclass
class _Decoded:
    image: Image.Image  # RGB, stored orientation, possibly draft-scaled
    format: str
    full_size: tuple[int, int]  # stored orientation, from the header
    orientation: int


def _orientation(img: Image.Image) -> int:
    try:
        value = img.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # a malformed EXIF block must not fail an otherwise good image
        log.debug("unreadable EXIF, orientation ignored", exc_info=True)
        return 1
    return value if isinstance(value, int) and value in _ORIENT_TRANSPOSE else 1


def _stored(size_hw: tuple[int, int], orientation: int) -> tuple[int, int]:
    """An upright (H, W) target as (W, H) in the stored orientation, as Pillow sizes go."""
    h, w = size_hw
    return (h, w) if orientation in _SWAPS_AXES else (w, h)


def _ocr_size(full: tuple[int, int], ocr_max_side: int) -> tuple[int, int]:
    w, h = full
    long_side = max(w, h)
    if long_side <= ocr_max_side:
        return w, h
    s = ocr_max_side / long_side
    return max(1, round(w * s)), max(1, round(h * s))


def _to_rgb(img: Image.Image) -> Image.Image:
    """Any decoded mode to 8-bit RGB; transparency is composited on white (what a viewer shows)."""
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:  # an RGB PNG may carry a colour key
        return img
    if mode.startswith("I") or mode == "F":
        # 16-/32-bit greyscale: Pillow's convert() would clip at 255, not rescale.
        arr = np.asarray(img).astype(np.float32)
        if mode.startswith("I;16") or (arr.size and float(arr.max()) > 255.0):
            arr *= 255.0 / 65535.0
        grey = Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8), "L")
        return grey.convert("RGB")
    if mode == "La":
        # Premultiplied grey and alpha (a TIFF with associated alpha), which Pillow converts to
        # nothing else: on white, a premultiplied grey v with alpha a shows as v + 255 - a.
        la = np.asarray(img).astype(np.int16)
        grey = Image.fromarray(np.clip(la[..., 0] + 255 - la[..., 1], 0, 255).astype(np.uint8),
                               "L")
        return grey.convert("RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa") or "transparency" in img.info:
        # Pasted on white through its own alpha: the same pixels as alpha_composite on a white
        # RGBA canvas, with one RGB copy instead of three RGBA ones (a 7000x7000 RGBA PNG
        # held 0.9 GB at once that way).
        rgba = img if mode == "RGBA" else img.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba)
        return out
    try:
        return img.convert("RGB")
    except ValueError as e:  # e.g. LAB without a colour profile
        raise ServiceError.of("not_an_image", f"unsupported colour mode {mode}") from e


#: Start-of-frame markers of arithmetic-coded JPEG (SOF9-11, SOF13-15), which the size bound of
#: :func:`_check_jpeg_size` does not cover.
_ARITHMETIC_SOF = frozenset({0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def _arithmetic_frame(data: bytes) -> bool:
    """Whether the JPEG's frame header, before its first scan, is arithmetic-coded.

    Walks the marker segments from SOI by their lengths, so the markers of a thumbnail inside an
    APP segment are skipped with it. (Pillow's tile offset cannot say where the scan starts: it
    is 0 for a JPEG, libjpeg reading from the start.)"""
    i = 2
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
        elif marker in (0xDA, 0xD9):  # start of scan or end of image: no arithmetic frame
            return False
        elif marker in _ARITHMETIC_SOF:
            return True
        elif 0xD0 <= marker <= 0xD8 or marker == 0x01:  # markers without a length
            i += 2
        else:
            i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return False


def _check_jpeg_size(data: bytes, size: tuple[int, int]) -> None:
    """libjpeg does not fail on a stream that ends early: it warns, and fills the rest of the
    picture with grey. So a 631-byte JPEG whose header says 6000x6000 would decode "fine" and
    be counted as a 36 MP image. Huffman coding spends at least one bit per 8x8 block on each
    block's DC coefficient, and the frame's largest component has a block for every 8x8 of
    the frame: fewer bytes than that is a stream that cannot hold the picture its header
    claims."""
    w, h = size
    need = -(-w // 8) * -(-h // 8) // 8
    if len(data) < need and not _arithmetic_frame(data):
        raise ServiceError.of("image_truncated", f"JPEG data ({len(data)} bytes) is too short "
                              f"for the {w}x{h} its header claims (a complete one needs at least "
                              f"{need} bytes)")


def _decode(data: bytes, settings: Settings, target_hw: tuple[int, int] | None,
            ocr_max_side: int | None) -> _Decoded:
    """Header checks, then decode, in draft mode when a JPEG's outputs are known to be smaller.

    ``target_hw`` (upright model size) and ``ocr_max_side`` say what the decoded picture must cover;
    ``target_hw=None`` asks for a full decode. Module-level, and looked up by
    :func:`~mrc_agent.reference_service.preprocess.core.preprocess` as a global of its module
    (``core._decode``), so tests can inject a slow decoder there.
    """
    img = _open(data, settings)
    fmt = str(img.format)
    full = img.size
    orientation = _orientation(img) if fmt in ("JPEG", "MPO") else 1
    if target_hw is not None and fmt in ("JPEG", "MPO"):
        need_w, need_h = _stored(target_hw, orientation)
        if ocr_max_side is not None:
            ow, oh = _ocr_size(full, ocr_max_side)
            need_w, need_h = max(need_w, ow), max(need_h, oh)
        # Pillow picks the largest of 1/8, 1/4, 1/2 that keeps both sides >= the request:
        # exactly "the smallest DCT scale whose output still covers the target".
        img.draft("RGB", (max(1, need_w), max(1, need_h)))
    try:
        img.load()
    except (OSError, EOFError) as e:
        msg = str(e)
        if isinstance(e, EOFError) or "truncated" in msg or "premature" in msg.lower():
            raise ServiceError.of("image_truncated", f"image data ends early: {msg}") from e
        raise ServiceError.of("image_corrupt", f"image data cannot be decoded: {msg}") from e
    except MemoryError:
        raise  # not the client's fault: pixel limits are checked; let it surface as a 500
    except Exception as e:  # any other decoder failure on client bytes is a bad image
        log.debug("image decode failed", exc_info=True)
        raise ServiceError.of("image_corrupt", f"image data cannot be decoded: {e}") from e
    if fmt in ("JPEG", "MPO"):
        _check_jpeg_size(data, full)
    else:
        orientation = _orientation(img)  # PNG/WebP/TIFF may carry EXIF after the header
    return _Decoded(_to_rgb(img), fmt, full, orientation)
