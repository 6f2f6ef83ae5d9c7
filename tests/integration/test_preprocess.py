"""Decode and preprocess: limits from the header, draft-mode decoding, colour modes, EXIF
orientation, the kornia (GPU) path on the CPU, and the decode timeout pool."""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import resource
import struct
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFile, ImageFont, ImageOps

from mrc_agent.reference_service import preprocess as P
from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.preprocess import core, decoding, gpu
from mrc_agent.reference_service.settings import Settings

MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's
STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)


# ------------------------------------------------------------------------------------ helpers


def photo(w: int, h: int, seed: int = 0) -> Image.Image:
    """Photo-like: smooth gradients, sensor noise, boxes with hard edges and some text."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    r = 128 + 100 * np.sin(x / w * 3.1 + 0.5) * np.cos(y / h * 2.3)
    g = 100 + 80 * (x / w) + 40 * np.sin((x + y) / (w / 13))
    b = 90 + 120 * (y / h)
    arr = np.stack([r, g, b], -1) + rng.normal(0, 6, (h, w, 3))
    img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    for _ in range(20):
        x0, y0 = int(rng.integers(0, w * 3 // 4)), int(rng.integers(0, h * 3 // 4))
        d.rectangle([x0, y0, x0 + w // 8, y0 + h // 10], outline=(20, 20, 20),
                    width=max(2, w // 400))
    d.text((w // 10, h // 2), "FRAGILE 12345", fill=(10, 10, 10),
           font=ImageFont.load_default(size=max(12, h // 12)))
    return img


def encode(img: Image.Image, fmt: str = "JPEG", **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def psnr(a: np.ndarray | Image.Image, b: np.ndarray | Image.Image) -> float:
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    assert x.shape == y.shape, (x.shape, y.shape)
    mse = float(((x - y) ** 2).mean())
    return 10 * np.log10(255.0**2 / max(mse, 1e-12))


def to_uint8(pixel_values: torch.Tensor, mean: tuple[float, ...] = MEAN,
             std: tuple[float, ...] = STD) -> np.ndarray:
    """Undo the normalisation: [1,3,H,W] -> HxWx3 uint8."""
    m = torch.tensor(mean).view(1, 3, 1, 1)
    s = torch.tensor(std).view(1, 3, 1, 1)
    x = (pixel_values.cpu() * s + m) * 255.0
    return x[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose IHDR claims w x h, with a token IDAT: what a bomb's header looks like."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def jpeg_claiming(w: int, h: int) -> bytes:
    """A small real JPEG with its SOF0 dimensions rewritten to w x h."""
    data = bytearray(encode(Image.new("RGB", (16, 16), (200, 10, 10))))
    i = data.index(b"\xff\xc0")
    data[i + 5:i + 9] = struct.pack(">HH", h, w)
    return bytes(data)


def err(fn: Callable[[], object]) -> ServiceError:
    with pytest.raises(ServiceError) as ei:
        fn()
    return ei.value


@pytest.fixture(scope="module")
def settings() -> Settings:
    return Settings()


@pytest.fixture(scope="module")
def big_photo() -> Image.Image:
    return photo(2400, 1800)


@pytest.fixture(scope="module")
def big_jpeg(big_photo: Image.Image) -> bytes:
    return encode(big_photo, quality=90)


# ------------------------------------------------------------------------------------- base64


def test_base64_raw_data_url_wrapped_and_urlsafe_all_decode() -> None:
    payload = bytes(range(256)) * 3
    std = base64.b64encode(payload).decode()
    assert P.decode_base64(std) == payload
    assert P.decode_base64("data:image/png;base64," + std) == payload
    assert P.decode_base64("DATA:image/jpeg;name=x.jpg;base64," + std) == payload
    wrapped = "\n".join(std[i:i + 76] for i in range(0, len(std), 76))
    assert P.decode_base64(wrapped + "\n") == payload
    assert P.decode_base64(base64.urlsafe_b64encode(payload).decode()) == payload


@pytest.mark.parametrize("text", [
    "not base64 at all!",
    "QUJD*",  # alphabet
    "QUJDRA",  # padding missing
    "QUJ=RA==",  # padding in the middle
    "QU+D-A==",  # mixed alphabets
    "data:image/png,QUJD",  # a data URL that is not base64
    "data:image/png;base64",  # no comma
])
def test_malformed_base64_is_400(text: str) -> None:
    e = err(lambda: P.decode_base64(text))
    assert (e.status, e.code) == (400, "bad_base64")


def test_empty_base64_is_image_empty() -> None:
    e = err(lambda: P.decode_base64("data:image/png;base64,"))
    assert (e.status, e.code) == (400, "image_empty")


def test_base64_size_limit_decided_on_encoded_length_before_decoding() -> None:
    limit = 3000
    ok = base64.b64encode(b"x" * limit).decode()
    assert len(P.decode_base64(ok, max_bytes=limit)) == limit
    over = base64.b64encode(b"x" * (limit + 1)).decode()
    assert err(lambda: P.decode_base64(over, max_bytes=limit)).status == 413
    # Invalid characters would be a 400 if anything were decoded: 413 proves the length came first.
    junk = "!" * (P.max_encoded_len(limit) + 4)
    e = err(lambda: P.decode_base64(junk, max_bytes=limit))
    assert (e.status, e.code) == (413, "image_too_large")


# ----------------------------------------------------------------------- header checks (probe)


def test_probe_reads_format_and_size(settings: Settings) -> None:
    assert P.probe(encode(Image.new("RGB", (64, 48)), "PNG"), settings) == ("PNG", 64, 48)
    assert P.probe(encode(Image.new("RGB", (64, 48))), settings) == ("JPEG", 64, 48)


def test_zero_bytes_and_zero_pixels_are_image_empty(settings: Settings) -> None:
    for data in (b"", png_header_only(0, 10), png_header_only(10, 0)):
        e = err(functools.partial(P.probe, data, settings))
        assert (e.status, e.code) == (400, "image_empty")


@pytest.mark.parametrize("data", [
    b"hello, world, this is text",
    # Pillow could open EPS (through Ghostscript); the service never does.
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n",
    b"\x00" * 1000,
    b"<svg xmlns='http://www.w3.org/2000/svg'/>",
])
def test_non_images_are_415(data: bytes, settings: Settings) -> None:
    e = err(lambda: P.probe(data, settings))
    assert (e.status, e.code) == (415, "not_an_image")


def test_image_magic_with_garbage_is_422_not_415(settings: Settings) -> None:
    e = err(lambda: P.probe(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10, settings))
    # Pillow reads the bogus chunk length as "truncated"; either way a damaged image, 422.
    assert e.status == 422 and e.code in ("image_corrupt", "image_truncated")


def test_50000x50000_png_refused_from_header_without_allocating(settings: Settings) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    e = err(lambda: P.probe(png_header_only(50000, 50000), settings))
    assert (e.status, e.code) == (413, "decompression_bomb")
    e = err(lambda: P.preprocess(png_header_only(50000, 50000), (336, 336), MEAN, STD, "cpu",
                                 1600, settings))
    assert e.code == "decompression_bomb"
    # 2.5 GP of RGB would be 7.5 GB; the peak RSS did not move by even 100 MB.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 100_000


def test_pixel_limit_is_ours_below_pillows_threshold(settings: Settings) -> None:
    # 64 MP: under Pillow's own warning level (~89 MP), over the service's 50 MP.
    assert (Image.MAX_IMAGE_PIXELS or 0) > 8000 * 8000
    for data in (png_header_only(8000, 8000), jpeg_claiming(8000, 8000)):
        e = err(functools.partial(P.probe, data, settings))
        assert (e.status, e.code) == (413, "decompression_bomb")
        assert "50000000-pixel limit" in e.message


def test_pillows_own_bomb_error_is_413() -> None:
    # With our limit set out of the way, Pillow's error (> 2x MAX_IMAGE_PIXELS) is the
    # backstop: a clean 413, not a 500.
    lax = Settings(max_image_pixels=10**12)
    e = err(lambda: P.probe(png_header_only(20000, 10000), lax))
    assert (e.status, e.code) == (413, "decompression_bomb")


def test_pillows_bomb_warning_is_no_second_limit() -> None:
    """The pixel limit is the service's own: Pillow's warning level (above MAX_IMAGE_PIXELS) is
    no longer turned into an error through a process-wide warnings filter, which needed a lock
    around every header parse. Above the service's limit the image never reaches Pillow."""
    lax = Settings(max_image_pixels=10**12)
    with pytest.warns(Image.DecompressionBombWarning):
        assert P.probe(png_header_only(10000, 9000), lax) == ("PNG", 10000, 9000)
    e = err(lambda: P.probe(png_header_only(10000, 9000), Settings()))
    assert (e.status, e.code) == (413, "decompression_bomb")


def test_bytes_over_limit_are_413() -> None:
    small = Settings(max_image_bytes=1000)
    data = encode(photo(200, 150), "PNG")
    assert len(data) > 1000
    e = err(lambda: P.probe(data, small))
    assert (e.status, e.code) == (413, "image_too_large")


# --------------------------------------------------------------------------- truncated, corrupt


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_truncated_images_are_422_truncated(fmt: str, keep: float, settings: Settings) -> None:
    data = encode(photo(400, 300), fmt)
    cut = data[: int(len(data) * keep)]
    e = err(lambda: P.preprocess(cut, (64, 64), MEAN, STD, "cpu", 200, settings))
    assert (e.status, e.code) == (422, "image_truncated")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False  # never switched on globally


def test_truncated_jpeg_header_is_422(settings: Settings) -> None:
    data = encode(photo(400, 300))[:100]
    e = err(lambda: P.preprocess(data, (64, 64), MEAN, STD, "cpu", None, settings))
    assert e.status == 422


def test_corrupt_jpeg_scan_is_4xx_never_500(settings: Settings) -> None:
    data = bytearray(encode(photo(400, 300)))
    rng = np.random.default_rng(1)
    start = data.index(b"\xff\xda") + 20
    for i in rng.integers(start, len(data) - 2, 200):
        data[int(i)] = 0xFF  # markers in the middle of entropy-coded data
    try:
        P.preprocess(bytes(data), (64, 64), MEAN, STD, "cpu", None, settings)
    except ServiceError as e:  # libjpeg may also repair it into a (garbled) image: fine
        assert e.status == 422


# ---------------------------------------------------------------------------- draft-mode decode


@pytest.mark.parametrize("target,ocr,expected", [
    ((336, 336), None, (600, 450)),  # 2400//336=7, 1800//336=5 -> 1/4
    ((224, 224), None, (300, 225)),  # -> 1/8
    ((336, 336), 800, (1200, 900)),  # OCR 800x600 needs 1/2
    ((336, 336), 1600, (2400, 1800)),  # OCR 1600x1200 needs the full size
    ((1000, 1000), None, (2400, 1800)),  # 1800//1000=1
])
def test_jpeg_draft_picks_smallest_covering_scale(
        big_jpeg: bytes, settings: Settings, target: tuple[int, int], ocr: int | None,
        expected: tuple[int, int]) -> None:
    r = P.preprocess(big_jpeg, target, MEAN, STD, "cpu", ocr, settings)
    assert r.decoded_size == expected
    assert (r.width, r.height, r.format) == (2400, 1800, "JPEG")
    # Covers the model input and the OCR image in both dimensions...
    ocr_w, ocr_h = decoding._ocr_size((2400, 1800), ocr) if ocr else (0, 0)
    dw, dh = r.decoded_size
    assert dw >= max(target[1], ocr_w) and dh >= max(target[0], ocr_h)
    # ...and the next DCT scale down would not have.
    if r.decoded_size != (300, 225):
        assert dw // 2 < max(target[1], ocr_w) or dh // 2 < max(target[0], ocr_h)


def test_non_jpeg_decodes_in_full(settings: Settings) -> None:
    data = encode(photo(800, 600), "PNG")
    r = P.preprocess(data, (64, 64), MEAN, STD, "cpu", None, settings)
    assert r.decoded_size == (800, 600) and r.format == "PNG"


def test_fast_path_matches_naive_full_decode_lanczos(big_jpeg: bytes, settings: Settings) -> None:
    naive = Image.open(io.BytesIO(big_jpeg)).convert("RGB")
    for ocr in (None, 1600):
        r = P.preprocess(big_jpeg, (336, 336), MEAN, STD, "cpu", ocr, settings)
        ref = naive.resize((336, 336), Image.Resampling.LANCZOS)
        assert psnr(to_uint8(r.pixel_values), ref) >= 30.0
    assert r.ocr_image is not None
    ref_ocr = naive.convert("L").resize(r.ocr_image.size, Image.Resampling.LANCZOS)
    assert psnr(r.ocr_image, ref_ocr) >= 30.0


def test_output_tensor_shape_dtype_and_normalisation(settings: Settings) -> None:
    data = encode(Image.new("RGB", (300, 200), (128, 64, 255)), "PNG")
    r = P.preprocess(data, (24, 40), HALF, HALF, "cpu", None, settings)
    assert r.pixel_values.shape == (1, 3, 24, 40)
    assert r.pixel_values.dtype == torch.float32 and r.pixel_values.device.type == "cpu"
    expected = torch.tensor([128, 64, 255]) / 255.0 * 2 - 1
    got = r.pixel_values[0, :, 12, 20]
    assert torch.allclose(got, expected, atol=1e-5)
    assert r.ocr_image is None
    assert r.decode_s >= 0 and r.preprocess_s >= 0


def test_ocr_image_long_side_and_never_upscaled(settings: Settings) -> None:
    r = P.preprocess(encode(photo(1200, 500)), (32, 32), MEAN, STD, "cpu", 600, settings)
    assert r.ocr_image is not None and r.ocr_image.size == (600, 250)
    assert r.ocr_image.mode == "L"
    r = P.preprocess(encode(photo(300, 200)), (32, 32), MEAN, STD, "cpu", 600, settings)
    assert r.ocr_image is not None and r.ocr_image.size == (300, 200)


def test_mean_std_must_be_rgb(settings: Settings) -> None:
    with pytest.raises(ValueError):
        P.preprocess(encode(photo(64, 64)), (32, 32), (0.5,), HALF, "cpu", None, settings)


# ------------------------------------------------------------------------------- colour modes


def _solid_modes() -> list[tuple[str, Image.Image, tuple[int, int, int]]]:
    rgba = Image.new("RGBA", (64, 48), (255, 0, 0, 0))  # fully transparent red -> white
    half = Image.new("RGBA", (64, 48), (0, 0, 255, 128))  # half blue over white
    pal = Image.new("RGB", (64, 48), (0, 200, 0)).convert("P")
    pal_t = Image.new("P", (64, 48), 0)
    pal_t.putpalette([10, 20, 30] + [0, 0, 0] * 255)
    pal_t.info["transparency"] = 0
    i16 = Image.fromarray(np.full((48, 64), 32896, np.uint16))  # 0x8080: mid grey in 16 bits
    return [
        ("RGBA transparent", rgba, (255, 255, 255)),
        ("RGBA half", half, (127, 127, 255)),
        ("LA", Image.new("LA", (64, 48), (0, 0)), (255, 255, 255)),
        ("P", pal, (0, 200, 0)),
        ("P transparent", pal_t, (255, 255, 255)),
        ("L", Image.new("L", (64, 48), 77), (77, 77, 77)),
        ("1", Image.new("1", (64, 48), 1), (255, 255, 255)),
        ("I;16", i16, (128, 128, 128)),
        ("CMYK", Image.new("CMYK", (64, 48), (0, 255, 255, 0)), (255, 0, 0)),
    ]


@pytest.mark.parametrize("name,img,rgb", _solid_modes(), ids=[m[0] for m in _solid_modes()])
def test_modes_become_rgb(name: str, img: Image.Image, rgb: tuple[int, int, int],
                          settings: Settings) -> None:
    fmt = "TIFF" if img.mode == "CMYK" else "PNG"
    data = encode(img, fmt)
    r = P.preprocess(data, (16, 16), HALF, HALF, "cpu", 32, settings)
    got = to_uint8(r.pixel_values, HALF, HALF)[8, 8]
    assert np.abs(got.astype(int) - np.array(rgb)).max() <= 2, (name, got)
    assert r.ocr_image is not None and r.ocr_image.mode == "L"


def test_cmyk_jpeg_decodes(settings: Settings) -> None:
    data = encode(Image.new("CMYK", (64, 48), (0, 255, 255, 0)), "JPEG", quality=95)
    r = P.preprocess(data, (16, 16), HALF, HALF, "cpu", None, settings)
    got = to_uint8(r.pixel_values, HALF, HALF)[8, 8].astype(int)
    assert got[0] > 200 and got[1] < 40 and got[2] < 40


# --------------------------------------------------------------------------- EXIF orientation


def _oriented_jpeg(base: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(base, quality=95, exif=exif)


@pytest.fixture(scope="module")
def asym() -> Image.Image:
    """Landscape with a distinct colour per corner, so any wrong flip or turn shows."""
    img = photo(960, 640, seed=3)
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, 240, 160], fill=(255, 0, 0))
    d.rectangle([720, 0, 959, 160], fill=(0, 255, 0))
    d.rectangle([0, 480, 240, 639], fill=(0, 0, 255))
    return img


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("backend", ["pil", "kornia"])
def test_exif_orientation_matches_exif_transpose(asym: Image.Image, orientation: int,
                                                 backend: P.ResizeBackend,
                                                 settings: Settings) -> None:
    data = _oriented_jpeg(asym, orientation)
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert upright is not None
    target = (60, 90)  # (H, W), not square: a missed axis swap changes the picture
    r = P.preprocess(data, target, MEAN, STD, "cpu", 300, settings, resize_backend=backend)
    assert (r.width, r.height) == upright.size
    ref = upright.convert("RGB").resize((90, 60), Image.Resampling.LANCZOS)
    assert psnr(to_uint8(r.pixel_values), ref) >= 25.0
    assert r.ocr_image is not None
    ref_ocr = upright.convert("L").resize(r.ocr_image.size, Image.Resampling.LANCZOS)
    assert r.ocr_image.size == decoding._ocr_size(upright.size, 300)
    assert psnr(r.ocr_image, ref_ocr) >= 28.0


# ------------------------------------------------------------------- kornia (GPU path) on CPU


def zone_plate(w: int, h: int) -> Image.Image:
    """Concentric rings whose frequency rises outwards: aliasing shows up as false rings."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r2 = (x - w / 2) ** 2 + (y - h / 2) ** 2
    v = (127.5 + 127.5 * np.cos(np.pi * r2 / (w * 0.9))).astype(np.uint8)
    return Image.fromarray(np.stack([v] * 3, -1))


def _kornia_u8(img: Image.Image, size_hw: tuple[int, int], antialias: bool) -> np.ndarray:
    t = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float()
    out = P.kornia_resize(t, size_hw, antialias=antialias)
    return out[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()


def test_kornia_backend_close_to_pil_on_a_photo(big_jpeg: bytes, settings: Settings) -> None:
    pil = P.preprocess(big_jpeg, (336, 336), MEAN, STD, "cpu", 800, settings,
                       resize_backend="pil")
    kor = P.preprocess(big_jpeg, (336, 336), MEAN, STD, "cpu", 800, settings,
                       resize_backend="kornia")
    assert kor.pixel_values.shape == pil.pixel_values.shape
    assert psnr(to_uint8(kor.pixel_values), to_uint8(pil.pixel_values)) >= 33.0
    assert kor.ocr_image is not None and pil.ocr_image is not None
    assert kor.ocr_image.size == pil.ocr_image.size and kor.ocr_image.mode == "L"
    assert psnr(kor.ocr_image, pil.ocr_image) >= 30.0


def test_kornia_without_antialias_is_measurably_worse() -> None:
    img = zone_plate(1200, 900)
    ref = np.asarray(img.resize((200, 150), Image.Resampling.LANCZOS))
    with_aa = psnr(_kornia_u8(img, (150, 200), True), ref)
    without = psnr(_kornia_u8(img, (150, 200), False), ref)
    assert with_aa >= 30.0
    assert with_aa - without >= 10.0, (with_aa, without)


def test_orient_tensor_matches_pil_transpose() -> None:
    img = photo(7, 5, seed=9)
    t = torch.from_numpy(np.array(img)).permute(2, 0, 1)
    for o, method in decoding._ORIENT_TRANSPOSE.items():
        want = np.array(img.transpose(method))
        got = gpu._orient_tensor(t, o).permute(1, 2, 0).numpy()
        assert np.array_equal(got, want), o


# ------------------------------------------------------------------------ decode timeout pool


def test_hung_decode_gets_504_and_the_pool_keeps_serving(
        monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    release = threading.Event()
    real = core._decode
    calls = {"n": 0}

    def decode(*args: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            release.wait(30)  # a decoder stuck on a corrupted stream
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(core, "_decode", decode)
    data = encode(photo(200, 150))

    async def main() -> None:
        pool = P.DecodePool(workers=1, max_stuck=2)
        t0 = time.monotonic()
        with pytest.raises(ServiceError) as ei:
            await P.preprocess_async(pool, data, (32, 32), MEAN, STD, "cpu", None, settings,
                                     timeout=0.3)
        elapsed = time.monotonic() - t0
        assert (ei.value.status, ei.value.code) == (504, "decode_timeout")
        assert elapsed < 5.0  # cut at ~0.3 s, far before the stuck decoder's 30 s
        assert pool.stats()["stuck"] == 1
        # The single worker is stuck, yet the next request is served by its replacement.
        r = await P.preprocess_async(pool, data, (32, 32), MEAN, STD, "cpu", None, settings,
                                     timeout=10)
        assert r.pixel_values.shape == (1, 3, 32, 32)
        release.set()
        for _ in range(100):
            if pool.stats()["stuck"] == 0:
                break
            await asyncio.sleep(0.05)
        assert pool.stats() == {"threads": 1, "stuck": 0, "queued": 0}
        pool.shutdown()

    asyncio.run(main())


def test_stuck_decodes_are_capped_with_503() -> None:
    release = threading.Event()

    async def main() -> None:
        pool = P.DecodePool(workers=1, max_stuck=1)
        with pytest.raises(ServiceError) as ei:
            await pool.run(release.wait, 30, timeout=0.2)
        assert ei.value.code == "decode_timeout"
        with pytest.raises(ServiceError) as ei:
            await pool.run(lambda: 1, timeout=1)
        assert (ei.value.status, ei.value.code) == (503, "decode_unavailable")
        release.set()
        for _ in range(100):
            if pool.stats()["stuck"] == 0:
                break
            await asyncio.sleep(0.05)
        assert await pool.run(lambda: 42, timeout=5) == 42
        pool.shutdown()

    asyncio.run(main())


def test_a_job_that_times_out_while_queued_never_runs() -> None:
    release = threading.Event()
    ran: list[int] = []

    async def main() -> None:
        pool = P.DecodePool(workers=1, max_stuck=4)
        blocker = asyncio.ensure_future(pool.run(release.wait, 30, timeout=10))
        await asyncio.sleep(0.1)  # the only thread is now busy
        with pytest.raises(ServiceError) as ei:
            await pool.run(ran.append, 1, timeout=0.2)
        assert ei.value.code == "decode_timeout"
        assert pool.stats()["stuck"] == 0  # it never started: nothing to write off
        release.set()
        assert await blocker is True
        assert await pool.run(lambda: "after", timeout=5) == "after"
        pool.shutdown()

    asyncio.run(main())
    assert ran == []


def test_errors_raised_in_the_pool_reach_the_caller(settings: Settings) -> None:
    async def main() -> None:
        pool = P.DecodePool(workers=2)
        with pytest.raises(ServiceError) as ei:
            await P.preprocess_async(pool, b"not an image", (32, 32), MEAN, STD, "cpu", None,
                                     settings)
        assert ei.value.code == "not_an_image"
        pool.shutdown()

    asyncio.run(main())


def test_pillows_bomb_guard_speaks_of_the_configured_limit(settings: Settings) -> None:
    # 100 MP: over Pillow's own threshold (~89 MP), so Pillow refuses first; the message still
    # quotes the service's configured limit, not the image library's.
    e = err(lambda: P.probe(png_header_only(10000, 10000), settings))
    assert (e.status, e.code) == (413, "decompression_bomb")
    assert "100000000 pixels" in e.message and "50000000-pixel limit" in e.message
    assert str(Image.MAX_IMAGE_PIXELS) not in e.message


def test_rgba_on_white_is_exactly_alpha_composite(settings: Settings) -> None:
    rng = np.random.default_rng(7)
    img = Image.fromarray(rng.integers(0, 256, (40, 50, 4), dtype=np.uint8), "RGBA")
    white = Image.new("RGBA", img.size, (255, 255, 255, 255))
    want = np.asarray(Image.alpha_composite(white, img).convert("RGB"))
    assert np.array_equal(np.asarray(decoding._to_rgb(img)), want)
    la = img.convert("LA")
    want_la = np.asarray(Image.alpha_composite(white, la.convert("RGBA")).convert("RGB"))
    assert np.array_equal(np.asarray(decoding._to_rgb(la)), want_la)


# ------------------------------------------------------------ streams shorter than their header


def _claiming(w: int, h: int) -> bytes:
    """A complete 16x16 JPEG whose frame header is rewritten to say ``w`` x ``h``."""
    data = bytearray(encode(photo(16, 16), "JPEG"))
    sof = data.find(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", h, w)
    return bytes(data)


def test_a_tiny_jpeg_claiming_36_megapixels_is_truncated(settings: Settings) -> None:
    data = _claiming(6000, 6000)
    assert len(data) < 1000
    with pytest.raises(ServiceError) as e:
        P.preprocess(data, (32, 32), HALF, HALF, "cpu", None, settings)
    assert e.value.code == "image_truncated" and "6000x6000" in e.value.message


@pytest.mark.parametrize("progressive", [False, True])
def test_a_flat_jpeg_of_12_megapixels_is_not_short(settings: Settings,
                                                   progressive: bool) -> None:
    # The most compressible real picture: one grey, quality 1. Huffman coding still needs a
    # bit per 8x8 block, so the bound must let it through.
    buf = io.BytesIO()
    Image.new("L", (4000, 3000), 128).save(buf, "JPEG", quality=1, progressive=progressive)
    r = P.preprocess(buf.getvalue(), (32, 32), HALF, HALF, "cpu", None, settings)
    assert (r.width, r.height) == (4000, 3000)


# ----------------------------------------------------------------- header probe off the loop


def test_a_crafted_header_is_refused_as_corrupt_off_the_event_loop() -> None:
    settings = Settings(header_timeout_s=5)
    data = b"\xff\xd8" + b"\xff" * 3_000_000  # Pillow walked fill bytes one at a time: 1 s
    pool = P.DecodePool(workers=1, max_stuck=4, name="test-header")
    try:
        e = err(lambda: asyncio.run(P.probe_async(pool, data, settings)))
        assert (e.status, e.code) == (422, "image_corrupt") and "fill" in e.message
        assert pool.stats()["stuck"] == 0
    finally:
        pool.shutdown()


def test_a_header_probe_that_overruns_its_budget_is_503_not_the_images_fault(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Header work is bounded by count, so a probe still running at its budget was starved
    (CPU, GIL): the service's state. It was 422 image_corrupt, blaming a good image."""
    settings = Settings(header_timeout_s=0.05)
    release = threading.Event()
    real = core.probe

    def starved(data: bytes, s: Settings) -> tuple[str, int, int]:
        release.wait(10)
        return real(data, s)

    monkeypatch.setattr(core, "probe", starved)
    pool = P.DecodePool(workers=1, max_stuck=4, name="test-header")

    async def go() -> tuple[ServiceError, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            with pytest.raises(ServiceError) as e:
                await P.probe_async(pool, encode(photo(16, 16), "JPEG"), settings)
            await asyncio.sleep(0.05)
        finally:
            ticker.cancel()
        return e.value, ticks

    try:
        err_, ticks = asyncio.run(go())
        assert (err_.status, err_.code) == (503, "decode_unavailable")
        assert "not read within 0.05s" in err_.message
        assert ticks >= 2  # the loop ran while the header was parsed
    finally:
        release.set()
        pool.shutdown()


def test_a_header_probe_waiting_for_a_thread_is_503() -> None:
    settings = Settings(header_timeout_s=0.05)
    pool = P.DecodePool(workers=1, max_stuck=4, name="test-header")
    release = threading.Event()

    async def go() -> ServiceError:
        blocker = asyncio.ensure_future(pool.run(release.wait, 5, timeout=10))
        await asyncio.sleep(0.02)
        try:
            with pytest.raises(ServiceError) as e:
                await P.probe_async(pool, encode(photo(16, 16), "JPEG"), settings)
        finally:
            release.set()
            await blocker
        return e.value

    try:
        err = asyncio.run(go())
        assert err.code == "decode_unavailable" and err.status == 503
        assert err.message == "every header-parsing thread is busy; try again later"
    finally:
        pool.shutdown()
