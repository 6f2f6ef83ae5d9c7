"""The "naive" preprocessing path: how many MRC services start, kept to show the agent a starved
GPU (``--preprocess naive``, on in ``mrc-agent demo``). Never the service's default.

It does what the tuned path (:mod:`~mrc_agent.reference_service.preprocess.cpu`) avoids, on the
service's one decode thread (the service runs a single decode worker in this mode):

* the whole photo is decoded, never in JPEG draft mode (a 12-megapixel JPEG in full);
* the model image is a plain Lanczos resize of all of it, with no ``reducing_gap``;
* :func:`pil_to_tensor` turns its pixels into the model's input one Python float at a time, so
  the thread holds the GIL for the whole conversion: the function a flame graph of such a
  service names, and the one ``mrc_process_function_seconds_total`` names while the GPU starves.

The result matches the tuned path's to within resampling differences (the tests compare them);
only the cost differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch
from PIL import Image

from mrc_agent.reference_service.preprocess.decoding import (
    _ORIENT_TRANSPOSE,
    _Decoded,
    _ocr_size,
    _stored,
)


def pil_to_tensor(img: Image.Image, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``img`` (RGB) as a normalised float32 [1, 3, H, W] tensor, built value by value in
    Python: ``(v / 255 - mean) / std`` for every channel of every pixel."""
    width, height = img.size
    scale = [1.0 / (255.0 * s) for s in std]
    shift = [m / s for m, s in zip(mean, std, strict=True)]
    values: list[float] = []
    # An RGB image's flattened data is one (r, g, b) tuple per pixel.
    for r, g, b in cast("Iterable[tuple[int, int, int]]", img.get_flattened_data()):
        values.append(r * scale[0] - shift[0])
        values.append(g * scale[1] - shift[1])
        values.append(b * scale[2] - shift[2])
    hwc = torch.tensor(values, dtype=torch.float32).view(height, width, 3)
    return hwc.permute(2, 0, 1).contiguous()[None]


def _resize_naive(dec: _Decoded, target_hw: tuple[int, int], mean: Sequence[float],
                  std: Sequence[float], device: str, ocr_max_side: int | None
                  ) -> tuple[torch.Tensor, Image.Image | None]:
    img, o = dec.image, dec.orientation
    model_img = img.resize(_stored(target_hw, o), Image.Resampling.LANCZOS)
    if o in _ORIENT_TRANSPOSE:
        model_img = model_img.transpose(_ORIENT_TRANSPOSE[o])
    pixel_values = pil_to_tensor(model_img, mean, std).to(device)
    ocr_img: Image.Image | None = None
    if ocr_max_side is not None:
        ocr_img = img.convert("L").resize(_ocr_size(dec.full_size, ocr_max_side),
                                          Image.Resampling.LANCZOS)
        if o in _ORIENT_TRANSPOSE:
            ocr_img = ocr_img.transpose(_ORIENT_TRANSPOSE[o])
    return pixel_values, ocr_img
