"""The naive preprocessing path (``--preprocess naive``, reference_service/preprocess/naive.py):
the same model input as the tuned path, reached the slow way on one thread."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from mrc_agent.reference_service import preprocess as P
from mrc_agent.reference_service.__main__ import build_parser, settings_from_args
from mrc_agent.reference_service.preprocess.naive import pil_to_tensor
from mrc_agent.reference_service.settings import Settings

MEAN, STD = (0.48, 0.46, 0.41), (0.27, 0.26, 0.28)


def photo(w: int, h: int, orientation: int = 1) -> bytes:
    """A smooth JPEG (gradients, so resampling differences stay small), with an EXIF
    orientation when asked."""
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None, None]
    rgb = np.concatenate([np.broadcast_to(x, (h, w, 1)), np.broadcast_to(y, (h, w, 1)),
                          np.broadcast_to((x + y) / 2, (h, w, 1))], axis=2)
    img = Image.fromarray(rgb.astype(np.uint8), "RGB")
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    img.save(buf, "JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


def test_pil_to_tensor_is_the_normalised_pixels_channel_first() -> None:
    rng = np.random.default_rng(7)
    arr = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    got = pil_to_tensor(Image.fromarray(arr, "RGB"), MEAN, STD)
    want = (arr.astype(np.float32) / 255.0 - np.asarray(MEAN, np.float32)) / np.asarray(
        STD, np.float32)
    assert got.shape == (1, 3, 5, 7) and got.dtype == torch.float32
    assert np.allclose(got[0].permute(1, 2, 0).numpy(), want, atol=1e-5)


@pytest.mark.parametrize("orientation", [1, 6])
def test_the_naive_path_gives_the_tuned_paths_input_from_a_full_decode(orientation: int) -> None:
    data = photo(1600, 1200, orientation)
    tuned = P.preprocess(data, (96, 96), MEAN, STD, "cpu", 400, Settings(), resize_backend="pil")
    naive = P.preprocess(data, (96, 96), MEAN, STD, "cpu", 400,
                         Settings(preprocess="naive"), resize_backend="pil")
    # The tuned path decodes a draft; the naive one the whole photo.
    assert tuned.decoded_size != (1600, 1200) and naive.decoded_size == (1600, 1200)
    assert (naive.width, naive.height) == (tuned.width, tuned.height)
    assert naive.pixel_values.shape == tuned.pixel_values.shape == (1, 3, 96, 96)
    # Resampling differs (draft + reducing gap against plain Lanczos): a few levels at most.
    diff = (naive.pixel_values - tuned.pixel_values).abs() * min(STD) * 255
    assert float(diff.mean()) < 2.0 and float(diff.max()) < 16.0
    assert naive.ocr_image is not None and tuned.ocr_image is not None
    assert naive.ocr_image.size == tuned.ocr_image.size
    assert naive.ocr_image.mode == tuned.ocr_image.mode == "L"


def test_the_naive_path_decodes_on_one_thread_and_is_chosen_by_a_flag() -> None:
    assert Settings().decode_workers == 2
    assert Settings(preprocess="naive").decode_workers == 1
    assert Settings(preprocess="naive", preprocess_workers=4).decode_workers == 1
    parser = build_parser()
    assert settings_from_args(parser.parse_args([])).preprocess == "tuned"
    assert settings_from_args(parser.parse_args(["--preprocess", "naive"])).decode_workers == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--preprocess", "slow"])
