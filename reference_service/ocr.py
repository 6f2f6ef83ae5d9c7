"""The chain's intermediate step: OCR with Debian's tesseract, through pytesseract.

Thin adapter: the rest of the service sees :class:`OCR` and :class:`OCRError`, never pytesseract.
Tesseract runs as a child process per call, so a timeout really stops it (pytesseract kills the
process), unlike an in-process library call. An empty result is not an error here — the app
counts it as a chain break; a failure to run tesseract raises :class:`OCRError` and the app
decides (also a chain break, the request still answers).
"""

from __future__ import annotations

import logging
import re
import shutil
import unicodedata

from PIL import Image

log = logging.getLogger(__name__)

#: A line with no letter or digit is layout noise (rules, table borders, speckles read as "|",
#: "—", "~"); dropping it is what makes a blank photo come back as "".
_HAS_WORD = re.compile(r"[^\W_]")  # a letter or digit in any script
_SPACES = re.compile(r"[ \t\u00a0]+")


class OCRError(RuntimeError):
    """Tesseract is missing, timed out or failed; ``reason`` is one of those three words."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def clean_text(text: str) -> str:
    """Tesseract output -> tidy text: NFC, control characters gone, runs of spaces collapsed,
    lines trimmed, lines without any letter or digit dropped."""
    text = unicodedata.normalize("NFC", text)
    lines = []
    for line in text.splitlines():
        line = "".join(ch for ch in line if unicodedata.category(ch)[0] != "C")
        line = _SPACES.sub(" ", line).strip()
        if _HAS_WORD.search(line):
            lines.append(line)
    return "\n".join(lines)


class OCR:
    """Reads text from an image with tesseract; ``available`` says whether it can.

    ``psm`` 3 is tesseract's fully automatic page segmentation, right for photos where the text
    could be anywhere. ``thresholding`` 2 is Sauvola's local binarisation (tesseract >= 5): the
    default global Otsu threshold loses dark text on a photo's unevenly lit background entirely
    (a parcel photo that reads "" with Otsu reads every line with Sauvola). ``timeout_s`` bounds
    one call: OCR is an intermediate step of a request with its own latency budget.
    """

    def __init__(self, lang: str = "eng", psm: int = 3, thresholding: int = 2,
                 timeout_s: float = 10.0) -> None:
        self.lang = lang
        self.psm = psm
        self.thresholding = thresholding
        self.timeout_s = timeout_s
        self._available: bool | None = None
        self.unavailable_reason = ""

    @property
    def available(self) -> bool:
        """True when pytesseract imports, the binary is on PATH and ``lang`` is installed.

        Checked once (it runs ``tesseract --list-langs``) and remembered.
        """
        if self._available is None:
            self._available = self._check()
        return self._available

    def _check(self) -> bool:
        try:
            import pytesseract
        except ImportError:
            self.unavailable_reason = "pytesseract is not installed"
            return False
        cmd = pytesseract.pytesseract.tesseract_cmd
        if shutil.which(cmd) is None:
            self.unavailable_reason = (
                f"tesseract binary {cmd!r} not found (apt install tesseract-ocr)")
            return False
        try:
            langs = set(pytesseract.get_languages(config=""))
        except Exception as e:  # a broken install: report it as unavailable, with why
            self.unavailable_reason = f"tesseract --list-langs failed: {e}"
            return False
        missing = [lang for lang in self.lang.split("+") if lang not in langs]
        if missing:
            self.unavailable_reason = f"tesseract language data missing: {', '.join(missing)}"
            return False
        return True

    def read(self, image: Image.Image) -> str:
        """Cleaned text found in ``image`` ("" when there is none). Raises :class:`OCRError`."""
        if not self.available:
            raise OCRError("missing", self.unavailable_reason or "tesseract is not available")
        import pytesseract

        if image.mode not in ("L", "RGB"):
            image = image.convert("RGB")
        try:
            raw = pytesseract.image_to_string(
                image, lang=self.lang, timeout=self.timeout_s,
                config=f"--psm {self.psm} -c thresholding_method={self.thresholding}")
        except RuntimeError as e:
            # pytesseract raises a bare RuntimeError for its timeout (after killing tesseract);
            # TesseractError (a non-zero exit) is a RuntimeError too.
            if "timeout" in str(e).lower():
                raise OCRError("timeout", f"tesseract took longer than {self.timeout_s:g}s") from e
            raise OCRError("failed", f"tesseract failed: {e}") from e
        except OSError as e:  # TesseractNotFoundError, or the binary vanished
            raise OCRError("failed", f"tesseract failed: {e}") from e
        return clean_text(str(raw))
