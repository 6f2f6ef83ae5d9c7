"""Preprocessing's small decisions on small inputs: base64 length bounds and the messages a
client reads, magic-number sniffing, the async wrappers' defaults (decode timeout, backend,
OCR), and the geometry helpers shared by both resize paths.

``test_preprocess.py`` checks decoding and resizing on real pictures; these tests pin the
boundaries and branches those pictures do not reach. Every image here is a few hundred pixels.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from PIL import Image

from mrc_agent.reference_service import preprocess as P
from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.preprocess import core, decoding
from mrc_agent.reference_service.settings import Settings

HALF = (0.5, 0.5, 0.5)


def err(fn: Callable[[], object]) -> ServiceError:
    with pytest.raises(ServiceError) as ei:
        fn()
    return ei.value


def jpeg(w: int = 40, h: int = 30) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 100, 50)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def pool() -> Iterator[P.DecodePool]:
    p = P.DecodePool(workers=1, max_stuck=2, name="test-units")
    yield p
    p.shutdown()


# -- base64 ----------------------------------------------------------------------------------

def test_max_encoded_len_is_the_padded_length_of_that_many_bytes() -> None:
    assert [P.max_encoded_len(n) for n in range(8)] == [0, 4, 4, 4, 8, 8, 8, 12]
    for n in (1, 2, 3, 100, 3001):
        assert P.max_encoded_len(n) == len(base64.b64encode(b"\0" * n))


def test_the_coarse_guard_on_the_raw_text_allows_for_line_breaks_and_a_header() -> None:
    max_bytes = 3001
    limit = P.max_encoded_len(max_bytes)  # 4004
    bound = limit + limit // 50 + 1024  # 5108
    padded = "QUJD" + " " * (bound - 4)  # exactly the bound: stripped, then decoded
    assert P.decode_base64(padded, max_bytes=max_bytes) == b"ABC"
    e = err(lambda: P.decode_base64(padded + " ", max_bytes=max_bytes))
    assert (e.status, e.code) == (413, "image_too_large")
    assert e.message == "base64 image text is over the 3001-byte limit"


def test_the_decoded_length_is_checked_against_the_limit_too() -> None:
    # Four characters fit max_encoded_len(1) but decode to three bytes.
    assert P.decode_base64("QQ==", max_bytes=1) == b"A"
    e = err(lambda: P.decode_base64("QUJD", max_bytes=1))
    assert (e.status, e.code, e.message) == (413, "image_too_large",
                                              "image is over the 1-byte limit")
    e = err(lambda: P.decode_base64("QUJDRA==", max_bytes=1))
    assert e.message == "base64 image is over the 1-byte limit"


@pytest.mark.parametrize("text,message", [
    ("data:image/png;base64", "data URL is not of the form data:<type>;base64,<data>"),
    ("data:;base64,\n ", "the image is empty"),
    ("QUJDRA", "base64 length is not a multiple of 4 (bad padding)"),
    ("QU+D-A==", "base64 contains characters outside its alphabet"),
])
def test_base64_error_messages(text: str, message: str) -> None:
    e = err(lambda: P.decode_base64(text))
    assert e.message == message
    assert e.status == 400


# -- magic numbers ---------------------------------------------------------------------------

@pytest.mark.parametrize("data,fmt", [
    (b"RIFF\0\0\0\0WEBPXXXX", "WEBP"),
    (b"GIF87a", "GIF"),
    (b"GIF89a\0\0\0", "GIF"),
    (b"BMxx", "BMP"),
    (b"II*\0xxxx", "TIFF"),
    (b"MM\0*xxxx", "TIFF"),
])
@pytest.mark.filterwarnings("ignore:Corrupt EXIF data")  # Pillow's TIFF opener, on "xxxx"
def test_a_damaged_image_is_named_by_its_magic_number(data: bytes, fmt: str) -> None:
    e = err(lambda: P.probe(data, Settings()))
    assert (e.status, e.code) == (422, "image_corrupt")
    assert e.message == f"looks like {fmt} but its header cannot be read (truncated or corrupt)"


@pytest.mark.parametrize("data", [
    b"RIFF$\0\0\0WAVEfmt xxxxxxxx",  # a RIFF file, but a sound
    b"RIFX\0\0\0\0WEBPXXXX",  # WEBP in the wrong place of a non-RIFF file
    b"RIFF",
])
def test_riff_that_is_not_webp_is_not_an_image(data: bytes) -> None:
    e = err(lambda: P.probe(data, Settings()))
    assert (e.status, e.code) == (415, "not_an_image")


# -- async wrappers --------------------------------------------------------------------------

@pytest.fixture
def backends(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Records (backend, device) of each resize, running the real CPU code on the CPU."""
    calls: list[tuple[str, str]] = []
    real_pil, real_kornia = core._resize_pil, core._resize_kornia

    def spy(name: str, real: Callable[..., object]) -> Callable[..., object]:
        def resize(dec: object, target_hw: object, mean: object, std: object, device: str,
                   ocr_max_side: object) -> object:
            calls.append((name, device))
            return real(dec, target_hw, mean, std, "cpu", ocr_max_side)
        return resize

    monkeypatch.setattr(core, "_resize_pil", spy("pil", real_pil))
    monkeypatch.setattr(core, "_resize_kornia", spy("kornia", real_kornia))
    return calls


def test_async_preprocess_passes_backend_device_and_ocr_through(
        pool: P.DecodePool, backends: list[tuple[str, str]]) -> None:
    data, settings = jpeg(), Settings()
    # The device wait (a no-op on the CPU, an event sync on CUDA) is asked about every device.
    waits: list[str] = []

    async def main() -> list[core.Preprocessed]:
        return [
            # "auto" on a CUDA device is the kornia path; on the CPU, Pillow.
            await P.preprocess_async(pool, data, (8, 8), HALF, HALF, "cuda:0", None, settings,
                                     wait=waits.append),
            await P.preprocess_async(pool, data, (8, 8), HALF, HALF, "cpu", 20, settings,
                                     wait=waits.append),
            await P.preprocess_async(pool, data, (8, 8), HALF, HALF, "cpu", None, settings,
                                     resize_backend="kornia", wait=waits.append),
        ]

    cuda, cpu, forced = asyncio.run(main())
    assert backends == [("kornia", "cuda:0"), ("pil", "cpu"), ("kornia", "cpu")]
    # Its own default: "auto"
    P.preprocess(data, (8, 8), HALF, HALF, "cuda", None, settings, wait=waits.append)
    P.preprocess(data, (8, 8), HALF, HALF, "cuda:1", None, settings, resize_backend="pil",
                 wait=waits.append)
    assert backends[3:] == [("kornia", "cuda"), ("pil", "cuda:1")]
    assert waits == ["cuda:0", "cpu", "cpu", "cuda", "cuda:1"]
    assert cuda.ocr_image is None and forced.ocr_image is None
    assert cpu.ocr_image is not None and cpu.ocr_image.size == (20, 15)


def test_async_preprocess_is_cut_at_the_settings_decode_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real = core._decode

    def stuck(*args: object) -> object:
        release.wait(10)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(core, "_decode", stuck)
    pool = P.DecodePool(workers=1, max_stuck=2, name="test-units")
    try:
        e = err(lambda: asyncio.run(P.preprocess_async(
            pool, jpeg(), (8, 8), HALF, HALF, "cpu", None, Settings(decode_timeout_s=0.1))))
        assert (e.status, e.code) == (504, "decode_timeout")
        assert e.message == "image decoding took longer than 0.1s"
    finally:
        release.set()
        pool.shutdown()


def test_an_abandoned_thread_is_reported_until_it_retires() -> None:
    deltas: list[int] = []
    release = threading.Event()
    pool = P.DecodePool(workers=1, max_stuck=2, name="test-units", on_abandoned=deltas.append)
    try:
        e = err(lambda: asyncio.run(pool.run(release.wait, 10, timeout=0.05)))
        assert e.code == "decode_timeout"
        assert deltas == [1] and pool.stats()["stuck"] == 1
        release.set()
        deadline = time.monotonic() + 10
        while deltas != [1, -1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert deltas == [1, -1] and pool.stats()["stuck"] == 0
    finally:
        release.set()
        pool.shutdown()


def test_the_header_pool_caps_its_abandoned_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A header probe that overruns is abandoned like a decode, up to the same cap: past it new
    probes get 503 at once and no thread is started."""
    from mrc_agent.reference_service.main import build_state

    settings = Settings(header_timeout_s=0.05, preprocess_workers=1, ocr="off")
    state = build_state(settings)
    release = threading.Event()
    monkeypatch.setattr(core, "probe", lambda data, s: release.wait(10))
    pool = state.header_pool
    try:
        assert pool.max_stuck == 2
        for _ in range(2):
            e = err(lambda: asyncio.run(P.probe_async(pool, jpeg(), settings)))
            assert (e.status, e.code) == (503, "decode_unavailable")
        e = err(lambda: asyncio.run(P.probe_async(pool, jpeg(), settings)))
        assert (e.status, e.code) == (503, "decode_unavailable") and "stuck" in e.message
        assert pool.stats()["threads"] == 3  # one working, two written off, no more
        metrics = state.metrics.registry
        assert metrics.get_sample_value("mrc_preprocess_abandoned_threads",
                                        {"pool": "header"}) == 2
    finally:
        release.set()
        for p in (state.header_pool, state.decode_pool):
            p.shutdown()
        for ex in (state.model_pool, state.ocr_pool):
            ex.shutdown(wait=False)


def test_probe_async_answers_from_the_header(pool: P.DecodePool) -> None:
    assert asyncio.run(P.probe_async(pool, jpeg(40, 30), Settings())) == ("JPEG", 40, 30)


# -- colour modes ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode,value,grey", [
    ("I", 0, 0), ("I", 100, 100), ("I", 255, 255),  # 32-bit grey within 8 bits: as it is
    ("I", 256, 1), ("I", 65535, 255),  # beyond: read as 16-bit and scaled by 255/65535
    ("I", 70000, 255), ("I", -5, 0),  # clipped, never wrapped
    ("I;16", 255, 1), ("I;16", 32896, 128), ("I;16", 51529, 201),  # always 16-bit, rounded
    ("F", 1000.0, 4), ("F", 99.6, 100),
])
def test_deep_grey_modes_are_scaled_to_8_bits(mode: str, value: float, grey: int) -> None:
    out = decoding._to_rgb(Image.new(mode, (3, 2), value))
    assert out.mode == "RGB" and out.getpixel((1, 1)) == (grey, grey, grey)


@pytest.mark.parametrize("mode,colour", [
    ("PA", (5, 0)), ("RGBa", (0, 0, 0, 0)), ("LA", (9, 0)), ("RGBA", (1, 2, 3, 0)),
    ("La", (0, 0)),
])
def test_transparent_modes_show_white(mode: str, colour: tuple[int, ...]) -> None:
    assert decoding._to_rgb(Image.new(mode, (3, 2), colour)).getpixel((0, 0)) == (255, 255, 255)


def test_an_rgb_png_with_a_colour_key_shows_white_where_transparent() -> None:
    img = Image.new("RGB", (4, 2), (0, 0, 0))
    img.putpixel((0, 0), (10, 20, 30))
    r = Image.open(io.BytesIO(_encode(img, "PNG", transparency=(0, 0, 0))))
    r.load()
    out = decoding._to_rgb(r)
    assert (out.getpixel((0, 0)), out.getpixel((1, 0))) == ((10, 20, 30), (255, 255, 255))
    plain = Image.new("RGB", (2, 2), (1, 2, 3))
    assert decoding._to_rgb(plain) is plain  # nothing to convert: not even a copy


def _encode(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("la,grey", [
    ((0, 255), 0),  # opaque black stays black
    ((100, 128), 227),
    ((200, 100), 255),  # malformed (grey above its alpha): clipped to white, never wrapped
])
def test_premultiplied_grey_on_white(la: tuple[int, int], grey: int) -> None:
    out = decoding._to_rgb(Image.new("La", (3, 2), la))
    assert out.mode == "RGB" and out.getpixel((2, 1)) == (grey, grey, grey)


def test_a_tiff_with_premultiplied_alpha_is_composited_on_white() -> None:
    """Grey + associated alpha (ExtraSamples = 1) opens as Pillow's "La", which it cannot
    convert: a 500 before. 100 premultiplied at alpha 128 on white is 100 + 255 - 128."""
    data = bytearray(_encode(Image.new("LA", (16, 12), (100, 128)), "TIFF"))
    extra_samples = data.index(b"\x52\x01\x03\x00\x01\x00\x00\x00")  # tag 338, one SHORT
    data[extra_samples + 8:extra_samples + 10] = b"\x01\x00"  # 2 (unassociated) -> 1
    assert Image.open(io.BytesIO(data)).mode == "La"
    r = P.preprocess(bytes(data), (4, 4), HALF, HALF, "cpu", 16, Settings())
    assert (r.format, r.width, r.height) == ("TIFF", 16, 12)
    assert r.ocr_image is not None and r.ocr_image.getpixel((0, 0)) == 227
    assert torch.allclose(r.pixel_values, torch.full((1, 3, 4, 4), 227 / 255 * 2 - 1), atol=1e-5)


# -- EXIF orientation ------------------------------------------------------------------------

class _BadExif:
    def getexif(self) -> object:
        raise SyntaxError("not a TIFF header")


def test_unreadable_exif_is_orientation_1_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="mrc_agent.reference_service.preprocess"):
        assert decoding._orientation(_BadExif()) == 1  # type: ignore[arg-type]
    (record,) = caplog.records
    assert record.getMessage() == "unreadable EXIF, orientation ignored"
    assert record.exc_info is not None and record.exc_info[0] is SyntaxError


def test_an_orientation_outside_1_to_8_is_ignored() -> None:
    for value in (0, 9, 1):
        exif = Image.Exif()
        exif[0x0112] = value
        img = Image.open(io.BytesIO(_encode(Image.new("RGB", (8, 4)), "JPEG", exif=exif)))
        assert decoding._orientation(img) == 1


def test_a_png_carrying_exif_orientation_is_turned_upright() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6
    data = _encode(Image.new("RGB", (40, 20), (10, 20, 30)), "PNG", exif=exif)
    r = P.preprocess(data, (8, 8), HALF, HALF, "cpu", None, Settings())
    assert (r.width, r.height, r.decoded_size) == (20, 40, (40, 20))


# -- geometry and the JPEG length bound ------------------------------------------------------

def test_ocr_size_keeps_at_least_one_pixel_per_side() -> None:
    assert decoding._ocr_size((1000, 1), 100) == (100, 1)
    assert decoding._ocr_size((1, 1000), 100) == (1, 100)
    assert decoding._ocr_size((600, 250), 600) == (600, 250)
    assert decoding._ocr_size((1200, 500), 600) == (600, 250)


@pytest.mark.parametrize("size,need", [
    ((64, 64), 8),  # 64 blocks of 8x8, a bit each
    ((72, 72), 10),  # 9 x 9 = 81 blocks: 10 bytes (a partial byte rounds down, 81 // 8)
    ((9, 64), 2),  # a 9-pixel-wide frame has 2 block columns
    ((64, 9), 2),
    ((24, 24), 1),  # 9 blocks: one byte
])
def test_jpeg_length_bound_is_a_bit_per_block(size: tuple[int, int], need: int) -> None:
    decoding._check_jpeg_size(b"\0" * need, size)
    e = err(lambda: decoding._check_jpeg_size(b"\0" * (need - 1), size))
    w, h = size
    assert (e.status, e.code) == (422, "image_truncated")
    assert e.message == (f"JPEG data ({need - 1} bytes) is too short for the {w}x{h} its header "
                         f"claims (a complete one needs at least {need} bytes)")


def _segment(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body


def test_an_arithmetic_coded_frame_lifts_the_bound() -> None:
    """Arithmetic coding can spend less than a bit per block: the bound is for Huffman only."""
    sof0, sof9, sos = (_segment(m, b"\x08" + b"\0" * 14) for m in (0xC0, 0xC9, 0xDA))
    soi = b"\xff\xd8"
    decoding._check_jpeg_size(soi + _segment(0xE0, b"JFIF\0") + b"\xff" + sof9 + sos,
                              (6000, 6000))
    for huffman in (soi + sof0 + sos,
                    soi + sos + sof9,  # after the first scan: not the frame's header
                    # inside an APP segment (a thumbnail's): skipped with the segment
                    soi + _segment(0xE1, b"Exif\0\0" + sof9) + sof0 + sos):
        with pytest.raises(ServiceError):
            decoding._check_jpeg_size(huffman, (6000, 6000))


@pytest.mark.parametrize("between,arithmetic", [
    (b"", True),
    (b"\xff\xd0\xff\xd7\xff\xd8\xff\x01", True),  # RSTn, SOI, TEM: markers without a length
    (_segment(0xE1, b"x" * 300), True),  # a segment longer than 255 bytes is skipped whole
    (b"\xff\xd9", False),  # end of image: whatever follows is not this image's frame
    (b"\xff\xd9\x00\x02", False),  # (even if it could be read as a segment length)
])
def test_the_marker_walk_to_the_frame_header(between: bytes, arithmetic: bool) -> None:
    sof9 = _segment(0xC9, b"\x08" + b"\0" * 14)
    assert decoding._arithmetic_frame(b"\xff\xd8" + between + sof9) is arithmetic
    assert decoding._arithmetic_frame(b"\xff\xd8" + between + b"\xff\xc9\x00\x08") is arithmetic


def test_a_small_arithmetic_jpeg_is_not_refused_as_truncated() -> None:
    data = bytearray(jpeg(16, 16))
    sof = data.index(b"\xff\xc0")
    data[sof + 1] = 0xC9  # SOF9: the frame says arithmetic coding
    data[sof + 5:sof + 9] = struct.pack(">HH", 2000, 2000)  # 62500 blocks in under 1 kB
    r = P.preprocess(bytes(data), (32, 32), HALF, HALF, "cpu", None, Settings())
    assert (r.width, r.height) == (2000, 2000)
    data[sof + 1] = 0xC0  # the same bytes as a Huffman frame: truncated
    e = err(lambda: P.preprocess(bytes(data), (32, 32), HALF, HALF, "cpu", None, Settings()))
    assert e.code == "image_truncated"


# -- the CPU resize path ---------------------------------------------------------------------

def test_cpu_path_is_lanczos_for_the_model_and_bilinear_for_ocr_both_with_reducing_gap() -> None:
    # Ratios that are not whole numbers: a box reduce() alone cannot reach either size, so the
    # filter after it shows.
    src = Image.effect_noise((400, 300), 60).convert("RGB")
    r = P.preprocess(_encode(src, "PNG"), (29, 37), (0.0,) * 3, (1.0,) * 3, "cpu", 90,
                     Settings())
    model = np.asarray(src.resize((37, 29), Image.Resampling.LANCZOS, reducing_gap=1.0))
    got = r.pixel_values[0].permute(1, 2, 0).numpy() * 255.0
    assert np.abs(got - model).max() < 1e-3
    ocr = src.convert("L").resize((90, 68), Image.Resampling.BILINEAR, reducing_gap=1.0)
    assert r.ocr_image is not None and np.array_equal(np.asarray(r.ocr_image), np.asarray(ocr))


def test_cpu_path_puts_the_tensor_on_the_requested_device() -> None:
    # "meta" is a device without storage: any device but the CPU shows whether .to() happened.
    r = P.preprocess(jpeg(), (8, 8), HALF, HALF, "meta", None, Settings())
    assert r.pixel_values.device.type == "meta" and r.pixel_values.shape == (1, 3, 8, 8)


# -- the decoder -----------------------------------------------------------------------------

def _oriented(img: Image.Image, orientation: int, fmt: str = "JPEG", **kw: object) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _encode(img, fmt, exif=exif, **kw)


def test_a_phone_mpo_is_drafted_and_turned_like_a_jpeg() -> None:
    frames = [Image.new("RGB", (320, 240), (200, 30, 30)), Image.new("RGB", (320, 240))]
    data = _oriented(frames[0], 6, "MPO", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(data)).format == "MPO"
    r = P.preprocess(data, (32, 32), HALF, HALF, "cpu", None, Settings())
    assert (r.format, r.width, r.height) == ("MPO", 240, 320)
    assert r.decoded_size == (80, 60)  # a 1/4 draft: 1/8 would be 30 high, under 32


def test_the_draft_target_is_taken_in_the_stored_orientation() -> None:
    # Stored 800x200, upright 200x800; upright target 400 high x 100 wide is 400x100 stored:
    # a half-scale draft covers it exactly.
    data = _oriented(Image.new("RGB", (800, 200), (9, 99, 199)), 6)
    r = P.preprocess(data, (400, 100), HALF, HALF, "cpu", None, Settings())
    assert (r.width, r.height, r.decoded_size) == (200, 800, (400, 100))


def test_a_one_pixel_target_drafts_to_one_pixel() -> None:
    r = P.preprocess(jpeg(8, 8), (1, 1), HALF, HALF, "cpu", None, Settings())
    assert r.decoded_size == (1, 1) and r.pixel_values.shape == (1, 3, 1, 1)


def test_no_target_is_a_full_decode() -> None:
    dec = decoding._decode(jpeg(64, 48), Settings(), None, None)
    assert (dec.image.size, dec.full_size, dec.format, dec.image.mode) == (
        (64, 48), (64, 48), "JPEG", "RGB")


class _FailingImage:
    """What ``_open`` returns, with a decoder that fails as ``error`` says."""

    format = "PNG"
    size = (4, 4)
    tile: list[object] = []
    info: dict[str, object] = {}

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def load(self) -> None:
        raise self.error

    def getexif(self) -> dict[int, int]:
        return {}


@pytest.mark.parametrize("error,code,message", [
    (OSError("Premature end of data"), "image_truncated",
     "image data ends early: Premature end of data"),
    (EOFError("no more"), "image_truncated", "image data ends early: no more"),
    (OSError("image file is truncated"), "image_truncated",
     "image data ends early: image file is truncated"),
    (OSError("broken data stream when reading image file"), "image_corrupt",
     "image data cannot be decoded: broken data stream when reading image file"),
    (ValueError("tile cannot extend outside image"), "image_corrupt",
     "image data cannot be decoded: tile cannot extend outside image"),
])
def test_decoder_failures_are_the_clients_bad_image(
        monkeypatch: pytest.MonkeyPatch, error: BaseException, code: str, message: str) -> None:
    monkeypatch.setattr(decoding, "_open", lambda data, settings: _FailingImage(error))
    e = err(lambda: decoding._decode(b"x", Settings(), (4, 4), None))
    assert (e.code, e.message) == (code, message)


def test_running_out_of_memory_while_decoding_is_not_the_clients_fault(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoding, "_open", lambda data, settings: _FailingImage(MemoryError()))
    with pytest.raises(MemoryError):
        decoding._decode(b"x", Settings(), (4, 4), None)


def test_mean_and_std_must_have_three_values() -> None:
    for mean, std in (((0.5,), HALF), (HALF, (0.5, 0.5)), ((0.5,) * 4, HALF)):
        with pytest.raises(ValueError, match=r"^mean and std need 3 values \(RGB\)$"):
            P.preprocess(jpeg(), (8, 8), mean, std, "cpu", None, Settings())


def test_an_unexpected_decoder_failure_is_logged_with_its_traceback(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(decoding, "_open",
                        lambda data, settings: _FailingImage(ValueError("bad tile")))
    with caplog.at_level(logging.DEBUG, logger="mrc_agent.reference_service.preprocess"):
        err(lambda: decoding._decode(b"x", Settings(), (4, 4), None))
    (record,) = caplog.records
    assert record.getMessage() == "image decode failed"
    assert record.exc_info is not None and record.exc_info[0] is ValueError


def test_a_tiny_mpo_claiming_a_big_frame_is_truncated() -> None:
    frames = [Image.new("RGB", (16, 16), (200, 30, 30)), Image.new("RGB", (16, 16))]
    data = bytearray(_encode(frames[0], "MPO", save_all=True, append_images=frames[1:]))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", 3000, 3000)
    e = err(lambda: P.preprocess(bytes(data), (32, 32), HALF, HALF, "cpu", None, Settings()))
    assert e.code == "image_truncated" and "3000x3000" in e.message


# -- header limits ---------------------------------------------------------------------------

def _png_header(w: int, h: int) -> bytes:
    """A PNG whose IHDR claims w x h, with a token IDAT."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def test_the_byte_limit_is_inclusive() -> None:
    data = jpeg(16, 16)
    assert P.probe(data, Settings(max_image_bytes=len(data))) == ("JPEG", 16, 16)
    e = err(lambda: P.probe(data, Settings(max_image_bytes=len(data) - 1)))
    assert (e.status, e.code) == (413, "image_too_large")
    assert e.message == f"image is {len(data)} bytes, over the {len(data) - 1}-byte limit"
    e = err(lambda: P.probe(b"", Settings()))
    assert (e.code, e.message) == ("image_empty", "the image is empty (0 bytes)")


def test_the_pixel_limit_is_inclusive() -> None:
    data = jpeg(64, 48)
    assert P.probe(data, Settings(max_image_pixels=64 * 48)) == ("JPEG", 64, 48)
    e = err(lambda: P.probe(data, Settings(max_image_pixels=64 * 48 - 1)))
    assert (e.status, e.code) == (413, "decompression_bomb")
    assert e.message == "image is 64x48 = 3072 pixels, over the 3071-pixel limit"


def test_pillows_bomb_guard_quotes_the_lower_of_the_two_limits() -> None:
    e = err(lambda: P.probe(_png_header(20000, 10000), Settings(max_image_pixels=10**12)))
    assert e.code == "decompression_bomb"
    assert e.message == (f"image is 200000000 pixels, over the {Image.MAX_IMAGE_PIXELS}-pixel "
                         "limit (refused before decoding)")


def test_a_header_the_parser_chokes_on_is_corrupt_with_the_parsers_words() -> None:
    e = err(lambda: P.probe(b"RIFF\0\0\0\0WEBPVP8X" + b"\0" * 30, Settings()))
    assert (e.status, e.code) == (422, "image_corrupt")
    assert e.message == "image header cannot be parsed: could not create decoder object"


def test_short_or_foreign_headers_are_not_mistaken_for_an_empty_png() -> None:
    # Ten bytes of PNG: a damaged PNG (too short to hold a size), not a crash on the IHDR.
    e = err(lambda: P.probe(b"\x89PNG\r\n\x1a\n\0\0", Settings()))
    assert (e.code, e.message) == (
        "image_corrupt", "looks like PNG but its header cannot be read (truncated or corrupt)")
    # "IHDR" and zero sizes where a PNG would have them, without the PNG signature.
    e = err(lambda: P.probe(b"\0" * 12 + b"IHDR" + b"\0" * 8, Settings()))
    assert (e.status, e.code) == (415, "not_an_image")
    assert e.message == "not an image in a supported format (JPEG, PNG, WEBP, GIF, BMP, TIFF)"
    e = err(lambda: P.probe(_png_header(0, 10), Settings()))
    assert (e.code, e.message) == ("image_empty", "PNG header says the image has no pixels")


def test_a_header_parse_failure_is_logged_with_its_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="mrc_agent.reference_service.preprocess"):
        err(lambda: P.probe(b"RIFF\0\0\0\0WEBPVP8X" + b"\0" * 30, Settings()))
    (record,) = [r for r in caplog.records
                 if r.name.startswith("mrc_agent.reference_service.preprocess.")]
    assert record.getMessage() == "image header parse failed"
    assert record.exc_info is not None and record.exc_info[1] is not None


def test_stage_timings_are_durations_within_the_call() -> None:
    t0 = time.perf_counter()
    r = P.preprocess(jpeg(), (8, 8), HALF, HALF, "cpu", None, Settings())
    elapsed = time.perf_counter() - t0
    assert 0 <= r.decode_s <= elapsed and 0 <= r.preprocess_s <= elapsed
    assert r.decode_s + r.preprocess_s <= elapsed


def test_a_header_that_ends_early_is_truncated_not_corrupt() -> None:
    e = err(lambda: P.probe(_png_header(10, 10)[:24], Settings()))
    assert (e.status, e.code) == (422, "image_truncated")
    assert e.message == "image header ends early: Truncated File Read"


def test_one_pixel_wide_or_high_images_have_pixels() -> None:
    assert P.probe(jpeg(1, 5), Settings()) == ("JPEG", 1, 5)
    assert P.probe(jpeg(5, 1), Settings()) == ("JPEG", 5, 1)
