"""Image decoding and preprocessing for the MRC chain, with every limit checked before the work.

The order of checks is the point of this module: cheap refusals first, so a hostile input never
costs more than its header.

1. :func:`decode_base64` refuses by the *encoded* length before decoding anything.
2. :func:`probe` reads only the header: size in bytes, format (a fixed allowlist, so Pillow never
   hands a stream to Ghostscript or another exotic plugin), pixel count (a 50000×50000 PNG is
   refused here from 33 bytes of IHDR, with no allocation), including Pillow's own
   decompression-bomb check.
3. :func:`preprocess` decodes and produces the model input and the OCR image.

CPU path ("pil" backend): a JPEG is decoded in draft mode — libjpeg scales by 1/2, 1/4 or 1/8
inside the IDCT, so it never builds the full-resolution picture — at the smallest scale whose
output still covers both the model's input size and the OCR size; then a Lanczos resize with
``reducing_gap`` (a box ``reduce`` first, then Lanczos on the small remainder) for the model,
and a greyscale bilinear shrink for the OCR image. Other formats are decoded in full and resized
the same way. ``benchmarks/bench_preprocess.py`` measures this
against naive full decode + Lanczos (speed-up and PSNR).

GPU path ("kornia" backend, the default on CUDA): decode on the CPU in draft mode as well, then
resize and normalise on the device with ``kornia.geometry.transform.resize(antialias=True)``.
Antialiasing matters: plain bilinear downscaling of a 4000-pixel photo aliases fine print into
noise, which is exactly what the OCR step then fails to read. The backend can be forced on the
CPU (``resize_backend="kornia"``) so it is tested without a GPU.

EXIF orientation is honoured on every path in one way: targets are computed in the stored
orientation, and the *small* results are transposed afterwards (cheaper than transposing a full
photo, and identical to ``ImageOps.exif_transpose`` followed by a resize).

Decode timeout: a Python thread cannot be killed, so :class:`DecodePool` bounds the damage
instead of pretending to cancel. Decodes run on a small dedicated pool of daemon threads; a
decode that overruns ``decode_timeout_s`` gets the caller a 504 at once, its thread is written
off as *stuck* and a replacement thread is started, so the pool keeps its capacity. Stuck threads
are capped (``max_stuck``); past the cap new decodes get 503 until they drain. Why not a process
pool, which could kill a hung decoder? Every request would pay to ship up to 20 MiB in and
megabytes of pixels out through a pipe, plus a process per worker with its own memory; and the
decoders here work on a finite, size-checked buffer with pixel counts bounded before decoding,
so a "hang" is in practice a pathologically slow decode that ends, returning its thread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import enum
import io
import itertools
import logging
import queue
import re
import struct
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from reference_service.errors import ServiceError
from reference_service.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

ResizeBackend = Literal["auto", "pil", "kornia"]

#: Formats the service decodes. An allowlist, not Pillow's full registry: EPS would run
#: Ghostscript, and rarely used plugins are where decoder bugs live. (Phone-camera JPEGs with a
#: preview frame come back as format "MPO" through the JPEG opener; they are JPEGs for us.)
ALLOWED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")

#: Magic numbers of the allowed formats: bytes that *look* like an image but that Pillow cannot
#: open are a damaged image (422), not "not an image" (415).
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
)

#: Pillow's ``reducing_gap``: a box ``reduce()`` by the largest integer factor that stays within
#: this factor of the target, then Lanczos for the rest. Chosen by measurement as the fastest
#: setting that keeps PSNR well above 30 dB against plain Lanczos from the full image
#: (benchmarks/bench_preprocess.py, 4000x3000 photo, 2000x1500 half-scale draft -> 336x336):
#: gap 1.0 ~5 ms at ~39 dB, 2.0 ~10 ms at ~52 dB, no gap ~27 ms at ~56 dB. From a 1/8 draft
#: (500x375 -> 336x336) no reduce happens at any gap.
REDUCING_GAP = 1.0

#: Resampling for the greyscale OCR image, also measured: from a half-scale draft to 1600x1200,
#: bilinear (Pillow's is a proper antialiasing triangle filter when shrinking) takes ~9 ms at
#: ~40 dB against full-image Lanczos; bicubic ~13 ms at ~44 dB; Lanczos ~22 ms. Tesseract reads
#: the bilinear result as well (it binarises anyway).
OCR_RESAMPLE = Image.Resampling.BILINEAR

#: ITU-R 601-2 luma, the weights Pillow's ``convert("L")`` uses: the GPU path's OCR image is the
#: same greyscale the CPU path produces.
_LUMA = (0.299, 0.587, 0.114)

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

# Image.open may warn (DecompressionBombWarning) and we want that as an exception. The warnings
# filter is process-global and catch_warnings is not thread-safe before Python 3.14, so the few
# microseconds of header parsing under the filter are serialised.
_OPEN_LOCK = threading.Lock()


@dataclass
class Preprocessed:
    """One decoded request image, ready for the model and the OCR step."""

    #: Full-resolution size as received (upright, after EXIF orientation), for the resolution label.
    width: int
    height: int
    format: str
    #: float32 [1, 3, H, W], resized and normalised, on the requested device.
    pixel_values: torch.Tensor
    #: Greyscale, long side <= ocr_max_side (never upscaled); None when OCR is off.
    ocr_image: Image.Image | None
    #: Seconds in header parsing + (draft) decode + colour conversion: the "decode" stage.
    decode_s: float
    #: Seconds in resize, orientation and normalisation: the "preprocess" stage.
    preprocess_s: float
    #: What the decoder actually produced (smaller than width x height in draft mode, stored
    #: orientation): tells whether the fast path was taken.
    decoded_size: tuple[int, int]


# --------------------------------------------------------------------------------------------
# base64


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


# --------------------------------------------------------------------------------------------
# header checks


def _sniff(data: bytes) -> str | None:
    for magic, fmt in _MAGIC:
        if data.startswith(magic):
            return fmt
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


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
        with _OPEN_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ServiceError.of("decompression_bomb", f"refused before decoding: {e}") from e
    except UnidentifiedImageError as e:
        fmt = _sniff(data)
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
    if w * h > settings.max_image_pixels:
        raise ServiceError.of(
            "decompression_bomb",
            f"image is {w}x{h} = {w * h} pixels, over the {settings.max_image_pixels}-pixel limit")
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


# --------------------------------------------------------------------------------------------
# decode


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
    if mode == "RGB":
        return img
    if mode.startswith("I") or mode == "F":
        # 16-/32-bit greyscale: Pillow's convert() would clip at 255, not rescale.
        arr = np.asarray(img).astype(np.float32)
        if mode.startswith("I;16") or (arr.size and float(arr.max()) > 255.0):
            arr *= 255.0 / 65535.0
        grey = Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8), "L")
        return grey.convert("RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    try:
        return img.convert("RGB")
    except ValueError as e:  # e.g. LAB without a colour profile
        raise ServiceError.of("not_an_image", f"unsupported colour mode {mode}") from e


def _decode(data: bytes, settings: Settings, target_hw: tuple[int, int] | None,
            ocr_max_side: int | None) -> _Decoded:
    """Header checks, then decode, in draft mode when a JPEG's outputs are known to be smaller.

    ``target_hw`` (upright model size) and ``ocr_max_side`` say what the decoded picture must
    cover; ``target_hw=None`` asks for a full decode. Module-level so tests can inject a slow
    decoder here.
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
    if fmt not in ("JPEG", "MPO"):
        orientation = _orientation(img)  # PNG/WebP/TIFF may carry EXIF after the header
    return _Decoded(_to_rgb(img), fmt, full, orientation)


# --------------------------------------------------------------------------------------------
# resize + normalise


def _norm_consts(mean: Sequence[float], std: Sequence[float], device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    m = torch.tensor(list(mean), dtype=torch.float32, device=device).view(1, 3, 1, 1)
    s = torch.tensor(list(std), dtype=torch.float32, device=device).view(1, 3, 1, 1)
    # (x/255 - m)/s == x * scale + offset: one fused multiply-add instead of three passes.
    return 1.0 / (255.0 * s), -m / s


def _orient_tensor(t: torch.Tensor, orientation: int) -> torch.Tensor:
    """The transpose of ``_ORIENT_TRANSPOSE`` on the last two (H, W) dims of a tensor."""
    if orientation == 2:
        return t.flip(-1)
    if orientation == 3:
        return t.flip(-2, -1)
    if orientation == 4:
        return t.flip(-2)
    if orientation == 5:
        return t.transpose(-2, -1)
    if orientation == 6:
        return torch.rot90(t, -1, (-2, -1))
    if orientation == 7:
        return t.transpose(-2, -1).flip(-2, -1)
    if orientation == 8:
        return torch.rot90(t, 1, (-2, -1))
    return t


def _pil_to_uint8_tensor(img: Image.Image) -> torch.Tensor:
    """RGB PIL image -> uint8 [1, 3, H, W] (np.array copies, so the tensor owns writable memory)."""
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).unsqueeze(0)


def kornia_resize(t: torch.Tensor, size_hw: tuple[int, int], antialias: bool = True
                  ) -> torch.Tensor:
    """Resize a float [N, C, H, W] tensor with kornia (bilinear; antialiased unless told not)."""
    # Imported here: kornia costs ~1 s to import and only this path needs it.
    from kornia.geometry.transform import resize

    out: torch.Tensor = resize(t, size_hw, interpolation="bilinear", antialias=antialias)
    return out


def _resize_pil(dec: _Decoded, target_hw: tuple[int, int], mean: Sequence[float],
                std: Sequence[float], device: str, ocr_max_side: int | None
                ) -> tuple[torch.Tensor, Image.Image | None]:
    img, o = dec.image, dec.orientation
    model_img = img.resize(_stored(target_hw, o), Image.Resampling.LANCZOS,
                           reducing_gap=REDUCING_GAP)
    if o in _ORIENT_TRANSPOSE:
        model_img = model_img.transpose(_ORIENT_TRANSPOSE[o])
    # Normalised in numpy on purpose: single-threaded and ~1 ms, whereas torch's OpenMP kernels
    # for a tensor this small cost more in thread hand-off than in arithmetic, and far more when
    # the CPUs are busy with other requests' decodes.
    m = np.asarray(mean, dtype=np.float32)
    s = np.asarray(std, dtype=np.float32)
    arr = np.asarray(model_img, dtype=np.float32) * (1.0 / (255.0 * s)) - m / s
    pixel_values = torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))[None]
    pixel_values = pixel_values.to(device)
    ocr_img: Image.Image | None = None
    if ocr_max_side is not None:
        # Greyscale before resizing: a third of the work, and it is what tesseract reads.
        grey = img.convert("L")
        size = _ocr_size(dec.full_size, ocr_max_side)
        ocr_img = grey if grey.size == size else grey.resize(
            size, OCR_RESAMPLE, reducing_gap=REDUCING_GAP)
        if o in _ORIENT_TRANSPOSE:
            ocr_img = ocr_img.transpose(_ORIENT_TRANSPOSE[o])
    return pixel_values, ocr_img


def _resize_kornia(dec: _Decoded, target_hw: tuple[int, int], mean: Sequence[float],
                   std: Sequence[float], device: str, ocr_max_side: int | None
                   ) -> tuple[torch.Tensor, Image.Image | None]:
    o = dec.orientation
    x = _pil_to_uint8_tensor(dec.image).to(device).float()  # 0..255, stored orientation
    w_s, h_s = _stored(target_hw, o)
    resized = kornia_resize(x, (h_s, w_s), antialias=True)
    scale, offset = _norm_consts(mean, std, x.device)
    pixel_values = _orient_tensor(torch.addcmul(offset, resized, scale), o).contiguous()
    ocr_img: Image.Image | None = None
    if ocr_max_side is not None:
        luma = torch.tensor(_LUMA, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
        grey = (x * luma).sum(dim=1, keepdim=True)
        ow, oh = _ocr_size(dec.full_size, ocr_max_side)
        if (oh, ow) != tuple(grey.shape[-2:]):
            grey = kornia_resize(grey, (oh, ow), antialias=True)
        grey = _orient_tensor(grey, o)
        arr = grey.round_().clamp_(0, 255).to(torch.uint8)[0, 0].cpu().numpy()
        ocr_img = Image.fromarray(arr, "L")
    return pixel_values, ocr_img


def preprocess(
    data: bytes,
    target_hw: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    device: str,
    ocr_max_side: int | None,
    settings: Settings,
    *,
    resize_backend: ResizeBackend = "auto",
) -> Preprocessed:
    """Decode ``data`` and build the model input (and the OCR image) under ``settings`` limits.

    ``target_hw`` is the model's (height, width); the image is resized to exactly that (the
    processor's "resize to size" convention) and normalised as ``(x/255 - mean) / std``.
    ``resize_backend``: "auto" is kornia on CUDA devices and Pillow otherwise; "kornia" forces
    the GPU path's code on any device (tests). Blocking and CPU-heavy: call it through
    :func:`preprocess_async` from the event loop. Raises :class:`ServiceError` for bad images.
    """
    if len(mean) != 3 or len(std) != 3:
        raise ValueError("mean and std need 3 values (RGB)")
    backend = resize_backend
    if backend == "auto":
        backend = "kornia" if device.startswith("cuda") else "pil"
    t0 = time.perf_counter()
    dec = _decode(data, settings, target_hw, ocr_max_side)
    t1 = time.perf_counter()
    if backend == "kornia":
        pixel_values, ocr_img = _resize_kornia(dec, target_hw, mean, std, device, ocr_max_side)
    else:
        pixel_values, ocr_img = _resize_pil(dec, target_hw, mean, std, device, ocr_max_side)
    t2 = time.perf_counter()
    w, h = dec.full_size
    if dec.orientation in _SWAPS_AXES:
        w, h = h, w
    return Preprocessed(
        width=w, height=h, format=dec.format, pixel_values=pixel_values, ocr_image=ocr_img,
        decode_s=t1 - t0, preprocess_s=t2 - t1, decoded_size=dec.image.size)


# --------------------------------------------------------------------------------------------
# bounded decode pool + timeout


class _State(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    state: _State = _State.PENDING
    abandoned: bool = False


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the waiter timed out or was cancelled meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class DecodePool:
    """A fixed number of decode threads where a stuck decode only ever costs its own thread.

    :meth:`run` awaits a job with a timeout. On timeout the caller gets 504
    ``decode_timeout`` at once; a job still queued is dropped, a running one is *abandoned*: its
    thread is counted as stuck and a replacement thread starts, so ``workers`` threads stay
    available. When the abandoned job finally returns, its thread exits. At most ``max_stuck``
    threads may be stuck; beyond that :meth:`run` refuses with 503 ``decode_unavailable`` rather
    than growing without bound. Threads are daemons so a stuck one never blocks shutdown.
    """

    def __init__(self, workers: int, max_stuck: int | None = None,
                 name: str = "mrc-decode") -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.workers = workers
        self.max_stuck = 2 * workers if max_stuck is None else max_stuck
        self._name = name
        self._ids = itertools.count()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stuck = 0
        self._live = 0
        self._closed = False
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        # Called with self._lock held or before the pool is shared.
        self._live += 1
        t = threading.Thread(target=self._worker, name=f"{self._name}-{next(self._ids)}",
                             daemon=True)
        t.start()

    def _worker(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                with self._lock:
                    self._live -= 1
                return
            with self._lock:
                if job.state is _State.CANCELLED:
                    continue
                job.state = _State.RUNNING
            result: Any = None
            exc: BaseException | None = None
            try:
                result = job.fn(*job.args)
            except Exception as e:  # handed to the awaiting request, which decides
                exc = e
            with self._lock:
                job.state = _State.DONE
                abandoned = job.abandoned
                if abandoned:
                    self._stuck -= 1
                    self._live -= 1
            if abandoned:
                log.warning("abandoned decode finished after its timeout; thread %s retires",
                            threading.current_thread().name)
                return  # its replacement has been running since the timeout
            try:
                job.loop.call_soon_threadsafe(_settle, job.future, result, exc)
            except RuntimeError:  # the awaiting event loop is closed: nobody is listening
                log.debug("decode result dropped: event loop closed")

    async def run(self, fn: Callable[..., T], *args: Any, timeout: float | None) -> T:
        """Run ``fn(*args)`` on the pool; 504 ``decode_timeout`` after ``timeout`` seconds."""
        with self._lock:
            if self._closed:
                raise RuntimeError("DecodePool is shut down")
            if self._stuck >= self.max_stuck:
                raise ServiceError.of(
                    "decode_unavailable",
                    f"{self._stuck} image decodes are stuck past their timeout; try again later")
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop, loop.create_future())
        self._jobs.put(job)
        try:
            result: T = await asyncio.wait_for(job.future, timeout)
            return result
        except asyncio.TimeoutError:
            with self._lock:
                if job.state is _State.PENDING:
                    job.state = _State.CANCELLED
                    where = "waiting for a decode thread"
                elif job.state is _State.RUNNING:
                    job.abandoned = True
                    self._stuck += 1
                    self._spawn()
                    where = "decoding"
                else:  # finished in the same instant; its result is already discarded
                    where = "finishing"
                stuck = self._stuck
            log.warning("decode timed out after %.3gs while %s (stuck decodes: %d)",
                        timeout, where, stuck)
            raise ServiceError.of(
                "decode_timeout", f"image decoding took longer than {timeout:g}s") from None
        except asyncio.CancelledError:
            # The request went away: drop the job if it has not started; a running one
            # finishes normally and frees its thread.
            with self._lock:
                if job.state is _State.PENDING:
                    job.state = _State.CANCELLED
            raise

    def stats(self) -> dict[str, int]:
        """Threads alive, stuck (abandoned after a timeout) and jobs queued."""
        with self._lock:
            return {"threads": self._live, "stuck": self._stuck, "queued": self._jobs.qsize()}

    def shutdown(self) -> None:
        """Stop idle threads; stuck ones are daemons and end with the process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            n = self._live - self._stuck
        for _ in range(n):
            self._jobs.put(None)


async def preprocess_async(
    pool: DecodePool,
    data: bytes,
    target_hw: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    device: str,
    ocr_max_side: int | None,
    settings: Settings,
    *,
    resize_backend: ResizeBackend = "auto",
    timeout: float | None = None,
) -> Preprocessed:
    """:func:`preprocess` on ``pool``, cut after ``timeout`` (default
    ``settings.decode_timeout_s``) with 504 ``decode_timeout``. The event loop never blocks."""
    limit = settings.decode_timeout_s if timeout is None else timeout

    def job() -> Preprocessed:
        return preprocess(data, target_hw, mean, std, device, ocr_max_side, settings,
                          resize_backend=resize_backend)

    return await pool.run(job, timeout=limit)
