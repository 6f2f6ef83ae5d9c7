"""Header checks of an image: every limit its header can decide, before any pixel is decoded.

:func:`probe` (and :func:`_open`, which the decoder starts from) reads only the header: size in
bytes, format (a fixed allowlist, so Pillow never hands a stream to Ghostscript or another exotic
plugin) and pixel count (a 50000×50000 PNG is refused here from 33 bytes of IHDR, with no
allocation). Before Pillow sees a byte,
:func:`~mrc_agent.exporters.imagewalk.walk` bounds the work of its header walk by
count (a crafted header is refused in milliseconds) and reads the size, so the service's pixel limit
applies first; Pillow's own decompression-bomb error (at twice ``Image.MAX_IMAGE_PIXELS``) stays as
a backstop. No warnings filter and no lock: Pillow's DecompressionBombWarning (a size between its
threshold and twice it, which only a limit set above Pillow's lets through) stays a warning, and
every header parses on its own thread at once. When Pillow cannot identify the bytes, their magic
number says whether they are a damaged image (422) or not an image (415).
"""

from __future__ import annotations

import functools
import io
import logging
import re
import struct

from PIL import Image, UnidentifiedImageError

from mrc_agent.exporters.imagewalk import StructureError, sniff, walk
from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.settings import Settings

log = logging.getLogger(__name__)

#: Formats the service decodes. An allowlist, not Pillow's full registry: EPS would run
#: Ghostscript, and rarely used plugins are where decoder bugs live. (Phone-camera JPEGs with a
#: preview frame come back as format "MPO" through the JPEG opener; they are JPEGs for us.)
ALLOWED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


def _check_pixels(width: int, height: int, settings: Settings) -> None:
    if width * height > settings.max_image_pixels:
        raise ServiceError.of(
            "decompression_bomb", f"image is {width}x{height} = {width * height} pixels, over "
            f"the {settings.max_image_pixels}-pixel limit")


def _check_bytes(data: bytes, settings: Settings) -> None:
    if not data:
        raise ServiceError.of("image_empty", "the image is empty (0 bytes)")
    if len(data) > settings.max_image_bytes:
        raise ServiceError.of(
            "image_too_large",
            f"image is {len(data)} bytes, over the {settings.max_image_bytes}-byte limit")


def _open(data: bytes, settings: Settings) -> Image.Image:
    """Parse the header only and apply every limit that the header can decide."""
    _check_bytes(data, settings)
    try:
        walk(data, functools.partial(_check_pixels, settings=settings))
    except StructureError as e:
        raise ServiceError.of("image_corrupt", str(e)) from e
    try:
        img = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.DecompressionBombError as e:
        # Pillow's backstop fired: the service's own limit is set above it. Say it in the
        # service's terms, with the lower of the two limits (the one that refused).
        m = re.search(r"\((\d+) pixels\)", str(e))
        size = f"image is {m[1]} pixels" if m else "image is too large"
        limit = min(settings.max_image_pixels, int(Image.MAX_IMAGE_PIXELS or 0) or
                    settings.max_image_pixels)
        raise ServiceError.of("decompression_bomb", f"{size}, over the {limit}-pixel limit "
                              "(refused before decoding)") from e
    except UnidentifiedImageError as e:
        fmt = sniff(data)
        if (fmt == "PNG" and len(data) >= 24 and data[12:16] == b"IHDR"
                and 0 in struct.unpack(">II", data[16:24])):
            # Pillow refuses a 0-pixel PNG as unidentifiable; say what it really is.
            raise ServiceError.of("image_empty", "PNG header says the image has no pixels") from e
        if fmt is not None:
            raise ServiceError.of(
                "image_corrupt",
                f"looks like {fmt} but its header cannot be read (truncated or corrupt)") from e
        raise ServiceError.of(
            "not_an_image",
            f"not an image in a supported format ({', '.join(ALLOWED_FORMATS)})") from e
    except Exception as e:  # any parser failure on client bytes is the client's bad image
        log.debug("image header parse failed", exc_info=True)
        if "truncat" in str(e).lower():
            raise ServiceError.of("image_truncated", f"image header ends early: {e}") from e
        raise ServiceError.of("image_corrupt", f"image header cannot be parsed: {e}") from e
    w, h = img.size
    if w <= 0 or h <= 0:
        raise ServiceError.of("image_empty", f"image has no pixels ({w}x{h})")
    _check_pixels(w, h, settings)
    return img


def probe(data: bytes, settings: Settings) -> tuple[str, int, int]:
    """Format and stored size from the header alone, with byte, format and pixel limits applied.

    Raises :class:`ServiceError`: 400 ``image_empty``, 413 ``image_too_large`` /
    ``decompression_bomb``, 415 ``not_an_image``, 422 ``image_corrupt``.
    """
    img = _open(data, settings)
    try:
        return str(img.format), img.size[0], img.size[1]
    finally:
        img.close()
