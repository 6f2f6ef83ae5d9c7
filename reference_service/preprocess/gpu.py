"""The GPU resize path ("kornia" backend, the default on CUDA): resize and normalise on the device.

The picture is decoded on the CPU in draft mode as well
(:mod:`~mrc_agent.reference_service.preprocess.decoding`), then resized and normalised on the device
with ``kornia.geometry.transform.resize(antialias=True)``. Antialiasing matters: plain bilinear
downscaling of a 4000-pixel photo aliases fine print into noise, which is exactly what the OCR step
then fails to read. The OCR image is the same ITU-R 601 greyscale the CPU path produces. The backend
can be forced on the CPU (``resize_backend="kornia"``) so it is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from mrc_agent.reference_service.preprocess.decoding import _Decoded, _ocr_size, _stored

#: ITU-R 601-2 luma, the weights Pillow's ``convert("L")`` uses: the GPU path's OCR image is the
#: same greyscale the CPU path produces.
_LUMA = (0.299, 0.587, 0.114)


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
