"""OCR over Debian's tesseract: text is found, a blank image gives "", failures are OCRError."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from PIL import Image, ImageDraw, ImageFont

from mrc_agent.reference_service import ocr as ocr_mod
from mrc_agent.reference_service.ocr import OCR, OCRError, clean_text

DEJAVU = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf")

needs_tesseract = pytest.mark.skipif(shutil.which("tesseract") is None,
                                     reason="needs Debian's tesseract-ocr package")


def font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    if DEJAVU.exists():
        return ImageFont.truetype(str(DEJAVU), size)
    return ImageFont.load_default(size=size)


def label(lines: list[str], size: int = 64) -> Image.Image:
    img = Image.new("RGB", (1400, 120 + len(lines) * size * 3 // 2), (250, 248, 240))
    d = ImageDraw.Draw(img)
    for i, line in enumerate(lines):
        d.text((60, 60 + i * size * 3 // 2), line, fill=(15, 15, 15), font=font(size))
    return img


@needs_tesseract
def test_available() -> None:
    o = OCR()
    assert o.available, o.unavailable_reason


@needs_tesseract
def test_reads_rendered_text() -> None:
    text = OCR().read(label(["FRAGILE HANDLE WITH CARE", "PARCEL 48213"]))
    assert "FRAGILE" in text.upper()
    assert "48213" in text
    assert "CARE" in text.upper()


@needs_tesseract
def test_reads_dark_text_on_an_unevenly_lit_background() -> None:
    # A photo is lit unevenly: a global threshold splits the page into black and white blobs.
    w, h = 1400, 500
    ramp = Image.linear_gradient("L").rotate(90).resize((w, h))  # dark left, light right
    img = Image.merge("RGB", [ramp.point(lambda v: 60 + v * 150 // 255)] * 3)
    d = ImageDraw.Draw(img)
    d.text((60, 80), "HANDLE WITH CARE", fill=(10, 10, 10), font=font(72))
    d.text((60, 260), "PARCEL 90417 LONDON", fill=(10, 10, 10), font=font(56))
    text = OCR().read(img).upper()
    assert "CARE" in text and "90417" in text


@needs_tesseract
def test_reads_a_greyscale_image_too() -> None:
    assert "DELIVERED" in OCR().read(label(["DELIVERED"]).convert("L")).upper()


@needs_tesseract
@pytest.mark.parametrize("colour", [(255, 255, 255), (0, 0, 0), (128, 140, 150)])
def test_blank_image_reads_as_empty(colour: tuple[int, int, int]) -> None:
    assert OCR().read(Image.new("RGB", (800, 600), colour)) == ""


@needs_tesseract
def test_timeout_is_an_ocr_error() -> None:
    big = label(["TIMEOUT " * 8] * 12, size=48)
    with pytest.raises(OCRError) as ei:
        OCR(timeout_s=0.01).read(big)  # tesseract cannot even start in 10 ms
    assert ei.value.reason == "timeout"


def test_missing_binary_is_unavailable_and_read_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ocr_mod.shutil, "which", lambda cmd: None)
    o = OCR()
    assert not o.available
    assert "not found" in o.unavailable_reason
    with pytest.raises(OCRError) as ei:
        o.read(Image.new("L", (10, 10)))
    assert ei.value.reason == "missing"


@needs_tesseract
def test_missing_language_is_unavailable() -> None:
    o = OCR(lang="xxx")
    assert not o.available and "xxx" in o.unavailable_reason


def test_clean_text() -> None:
    raw = "  FRAGILE \t  HANDLE  \n\n|\n — \n PARCEL\u00a0 48213 \x0c"
    assert clean_text(raw) == "FRAGILE HANDLE\nPARCEL 48213"
    assert clean_text("\x0c") == ""
    assert clean_text(" ~ | _ \n__") == ""
    assert clean_text("包裹 ２") == "包裹 ２"


def dense_page() -> Image.Image:
    """A page of small dense text: tesseract works on it for many seconds."""
    img = Image.new("L", (2400, 2400), 255)
    d = ImageDraw.Draw(img)
    words = "parcel label fragile track route depot scan seal box return invoice weight"
    for y in range(0, 2400, 11):
        d.text((2, y), (words + " ") * 6, fill=0)
    return img


def _children(name: str) -> list[int]:
    """PIDs of this process's children called ``name``."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if comm == name and int(fields[1]) == me:
            found.append(int(entry))
    return found


def _cmdline(pid: int) -> bytes:
    """The process's command line, empty once it has gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


@needs_tesseract
def test_a_long_read_is_demoted_to_nice_19_on_one_thread_and_cancelled_on_request() -> None:
    """A page of dense text keeps tesseract busy past its demotion point: the child runs with
    one OpenMP thread and, once demoted, at nice 19; setting ``cancel`` kills it and the call
    raises ``preempted`` (the request then answers without the text)."""
    cancel = threading.Event()
    got: dict[str, BaseException | str] = {}

    def read() -> None:
        try:
            got["text"] = OCR(timeout_s=120, demote_after_s=0.2).read(dense_page(), cancel)
        except OCRError as exc:
            got["error"] = exc

    t = threading.Thread(target=read, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    pids: list[int] = []
    while time.monotonic() < deadline and not pids:
        # The read's child, not the short-lived ``--list-langs`` probe the first read runs.
        pids = [pid for pid in _children("tesseract") if b"--psm" in _cmdline(pid)]
        time.sleep(0.05)
    assert len(pids) == 1, "tesseract did not start"
    with open(f"/proc/{pids[0]}/environ", "rb") as f:
        assert b"OMP_THREAD_LIMIT=1" in f.read().split(b"\0")
    while time.monotonic() < deadline and _nice(pids[0]) != 19:
        assert t.is_alive(), got  # the page must outlast the demotion point
        time.sleep(0.05)
    assert _nice(pids[0]) == 19
    cancel.set()
    t.join(30)
    assert not t.is_alive()
    error = got.get("error")
    assert isinstance(error, OCRError) and error.reason == "preempted", got
    assert _children("tesseract") == []  # killed and reaped
