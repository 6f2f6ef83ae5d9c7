"""Base64 and ``data:…;base64,`` URL decoding of request images, refused by length first.

The first and cheapest of the preprocessing checks: :func:`decode_base64` refuses text by its
*encoded* length before decoding or copying anything, and decodes strictly (one alphabet,
correct padding). :func:`max_encoded_len` gives the matching limit on the text, which the app
uses to size the request-body cap.
"""

from __future__ import annotations

import base64
import binascii
import re

from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.settings import Settings

_DATA_URL = re.compile(r"data:(?P<mime>[^,;]*)(?P<params>(;[^,;]*)*?);base64,", re.IGNORECASE)
_WS = re.compile(r"[ \t\r\n]+")
_B64_STD = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_B64_URL = re.compile(r"[A-Za-z0-9_-]*={0,2}")


def max_encoded_len(max_bytes: int) -> int:
    """Longest padded base64 text that can decode to at most ``max_bytes`` bytes."""
    return 4 * ((max_bytes + 2) // 3)


def decode_base64(s: str, max_bytes: int = Settings.max_image_bytes) -> bytes:
    """Decode raw base64 or a ``data:…;base64,`` URL, strictly, refusing by length first.

    Accepted: the standard or the URL-safe alphabet (not mixed), correct ``=`` padding, and line
    breaks/spaces (MIME-wrapped base64 is common). Anything else is 400 ``bad_base64``. Text whose
    length alone implies more than ``max_bytes`` decoded bytes is 413 ``image_too_large``, decided
    before any decoding or copying.
    """
    limit = max_encoded_len(max_bytes)
    # Coarse guard on the raw text (data URL header and line breaks allowed for) so a huge string
    # is refused before we even strip it.
    if len(s) > limit + limit // 50 + 1024:
        raise ServiceError.of("image_too_large",
                              f"base64 image text is over the {max_bytes}-byte limit")
    body = s.strip()
    if body[:5].lower() == "data:":
        m = _DATA_URL.match(body)
        if m is None:
            raise ServiceError.of("bad_base64",
                                  "data URL is not of the form data:<type>;base64,<data>")
        body = body[m.end():]
    body = _WS.sub("", body)
    if not body:
        raise ServiceError.of("image_empty", "the image is empty")
    if len(body) > limit:
        raise ServiceError.of("image_too_large", f"base64 image is over the {max_bytes}-byte limit")
    if len(body) % 4:
        raise ServiceError.of("bad_base64", "base64 length is not a multiple of 4 (bad padding)")
    if _B64_STD.fullmatch(body):
        alt: bytes | None = None
    elif _B64_URL.fullmatch(body):
        alt = b"-_"
    else:
        raise ServiceError.of("bad_base64", "base64 contains characters outside its alphabet")
    try:
        data = base64.b64decode(body, altchars=alt, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ServiceError.of("bad_base64", f"malformed base64: {e}") from e
    if len(data) > max_bytes:
        raise ServiceError.of("image_too_large", f"image is over the {max_bytes}-byte limit")
    return data
