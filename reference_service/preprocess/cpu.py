"""The CPU resize path ("pil" backend): Pillow resizes a decoded image into model and OCR inputs.

From the (possibly draft-scaled) picture of :mod:`~mrc_agent.reference_service.preprocess.decoding`:
a Lanczos resize with ``reducing_gap`` (a box ``reduce`` first, then Lanczos on the small remainder)
for the model, normalised in numpy, and a greyscale bilinear shrink for the OCR image; both
transposed upright afterwards. ``benchmarks/bench_preprocess.py`` measures this against naive full
decode + Lanczos (speed-up and PSNR).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from mrc_agent.reference_service.preprocess.decoding import (
    _ORIENT_TRANSPOSE,
    _Decoded,
    _ocr_size,
    _stored,
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
