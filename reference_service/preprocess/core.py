"""One request image from bytes to model input: :func:`preprocess`, its async form, its result.

:func:`preprocess` runs the decoder of :mod:`~mrc_agent.reference_service.preprocess.decoding`
(header checks first) and then one resize path: :mod:`~mrc_agent.reference_service.preprocess.cpu`
("pil") or :mod:`~mrc_agent.reference_service.preprocess.gpu` ("kornia", the default on CUDA),
timing the two stages; with ``--preprocess naive`` a full decode and
:mod:`~mrc_agent.reference_service.preprocess.naive` instead, the slow path kept for the demo. On a
CUDA device the end of the preprocess stage is stamped only once the work queued on the device has
run (:func:`~mrc_agent.reference_service.device.wait_for_queued_work`), so the resize is charged to
preprocessing and not to the prefill that would otherwise wait for it. :func:`preprocess_async` runs
it on a :class:`~mrc_agent.reference_service.preprocess.pool.DecodePool` under the decode timeout,
so the event loop never blocks; :func:`probe_async` does the same for the header checks.
:class:`Preprocessed` is the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from PIL import Image

from mrc_agent.reference_service.device import wait_for_queued_work
from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.preprocess.cpu import _resize_pil
from mrc_agent.reference_service.preprocess.decoding import _SWAPS_AXES, _decode
from mrc_agent.reference_service.preprocess.gpu import _resize_kornia
from mrc_agent.reference_service.preprocess.header import probe
from mrc_agent.reference_service.preprocess.naive import _resize_naive
from mrc_agent.reference_service.preprocess.pool import DecodePool
from mrc_agent.reference_service.settings import Settings

ResizeBackend = Literal["auto", "pil", "kornia"]
#: Blocks until the work queued on a device (the argument) has run; does nothing for a CPU.
DeviceWait = Callable[[str], None]


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
    wait: DeviceWait = wait_for_queued_work,
) -> Preprocessed:
    """Decode ``data`` and build the model input (and the OCR image) under ``settings`` limits.

    ``target_hw`` is the model's (height, width); the image is resized to exactly that (the
    processor's "resize to size" convention) and normalised as ``(x/255 - mean) / std``.
    ``resize_backend``: "auto" is kornia on CUDA devices and Pillow otherwise; "kornia" forces
    the GPU path's code on any device (tests). ``wait`` is called with ``device`` before the
    preprocess stage's end is stamped (a test passes a fake device's). Blocking and CPU-heavy:
    call it through :func:`preprocess_async` from the event loop. Raises :class:`ServiceError`
    for bad images.
    """
    if len(mean) != 3 or len(std) != 3:
        raise ValueError("mean and std need 3 values (RGB)")
    backend = resize_backend
    if backend == "auto":
        backend = "kornia" if device.startswith("cuda") else "pil"
    naive = settings.preprocess == "naive"
    t0 = time.perf_counter()
    dec = _decode(data, settings, None if naive else target_hw, ocr_max_side)
    t1 = time.perf_counter()
    if naive:
        pixel_values, ocr_img = _resize_naive(dec, target_hw, mean, std, device, ocr_max_side)
    elif backend == "kornia":
        pixel_values, ocr_img = _resize_kornia(dec, target_hw, mean, std, device, ocr_max_side)
    else:
        pixel_values, ocr_img = _resize_pil(dec, target_hw, mean, std, device, ocr_max_side)
    # Either path may leave kernels or a copy queued on a CUDA device (with OCR off nothing
    # reads back to the CPU); without this wait their time would land in the prefill stage.
    wait(device)
    t2 = time.perf_counter()
    w, h = dec.full_size
    if dec.orientation in _SWAPS_AXES:
        w, h = h, w
    return Preprocessed(
        width=w, height=h, format=dec.format, pixel_values=pixel_values, ocr_image=ocr_img,
        decode_s=t1 - t0, preprocess_s=t2 - t1, decoded_size=dec.image.size)


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
    wait: DeviceWait = wait_for_queued_work,
) -> Preprocessed:
    """:func:`preprocess` on ``pool``, cut after ``timeout`` (default
    ``settings.decode_timeout_s``): 504 ``decode_timeout`` when the decode itself ran that
    long, 503 ``decode_unavailable`` when it never got a thread (every decode thread busy: the
    service's state, a retry may work). The event loop never blocks."""
    limit = settings.decode_timeout_s if timeout is None else timeout

    def job() -> Preprocessed:
        return preprocess(data, target_hw, mean, std, device, ocr_max_side, settings,
                          resize_backend=resize_backend, wait=wait)

    def timed_out(running: bool) -> ServiceError:
        if running:
            return ServiceError.of("decode_timeout",
                                   f"image decoding took longer than {limit:g}s")
        return ServiceError.of("decode_unavailable", f"no image decode thread came free "
                               f"within {limit:g}s; try again later")

    return await pool.run(job, timeout=limit, on_timeout=timed_out)


async def probe_async(pool: DecodePool, data: bytes, settings: Settings) -> tuple[str, int, int]:
    """:func:`~mrc_agent.reference_service.preprocess.header.probe` on ``pool``, never on the event
    loop.

    The structure walk bounds a header's work by count (a crafted one is refused as corrupt in
    milliseconds), so a probe that has not answered within ``settings.header_timeout_s`` is the
    service's state, not the image's: every header thread busy, or the parse starved of CPU.
    Either way it is 503 ``decode_unavailable`` (``Retry-After``), never a 4xx that would blame
    a good image.
    """
    limit = settings.header_timeout_s

    def timed_out(running: bool) -> ServiceError:
        if running:
            return ServiceError.of("decode_unavailable", f"the image header was not read within "
                                   f"{limit:g}s: the service is busy; try again later")
        return ServiceError.of("decode_unavailable", "every header-parsing thread is busy; "
                               "try again later")

    return await pool.run(probe, data, settings, timeout=limit, on_timeout=timed_out)
