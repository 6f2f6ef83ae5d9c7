"""The chain's intermediate step: OCR with Debian's tesseract.

Thin adapter: the rest of the service sees :class:`OCR` and :class:`OCRError`, never tesseract.
Tesseract runs as a child process per call (pytesseract finds the binary and its languages), so
a timeout or a cancellation really stops it, unlike an in-process library call. An empty result
is not an error here — the app counts it as a chain break; a failure to run tesseract raises
:class:`OCRError` and the app decides (also a chain break, the request still answers).

What one call may cost is bounded three ways, because a client chooses the image and a page of
dense text keeps tesseract busy for its whole timeout (a photo's label takes a fraction of a
second):

* one core at most: tesseract's OpenMP threads are limited to one (``OMP_THREAD_LIMIT=1``,
  the setting tesseract's authors give for running several at once), so a page cannot take
  every core of the node;
* a call that has run longer than ``demote_after_s`` is *demoted*: its process is reniced to 19,
  so it goes on with the CPU nobody else wants and never slows the model's threads or a
  newer, short OCR (the kernel's fair scheduler gives a nice-19 process about 1/70 of a nice-0
  one's share when both want the CPU);
* a call can be cancelled (``cancel``): the step that runs OCR on a fixed number of threads
  takes the thread of the longest-running call when a new request finds none free
  (:class:`~mrc_agent.reference_service.limiter.BoundedStep`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import unicodedata

from PIL import Image

log = logging.getLogger(__name__)

#: A line with no letter or digit is layout noise (rules, table borders, speckles read as "|",
#: "—", "~"); dropping it is what makes a blank photo come back as "".
_HAS_WORD = re.compile(r"[^\W_]")  # a letter or digit in any script
_SPACES = re.compile(r"[ \t\u00a0]+")
#: Niceness of a demoted tesseract (the lowest priority there is).
DEMOTED_NICE = 19
#: How often a running call looks at its clock and its cancellation.
_POLL_S = 0.05


class OCRError(RuntimeError):
    """Tesseract is missing, timed out, was cancelled or failed; ``reason`` says which:
    ``missing``, ``timeout``, ``preempted`` or ``failed``."""

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
    ``demote_after_s`` (see the module): 0.5 s is several times a photo label's OCR on one
    core (a whole request for an 800x600 reference photo, OCR included, takes 0.14 s at the
    median on the project's 2-core machine), and a page of dense text spends half a second at
    the service's priority instead of its whole timeout.
    """

    def __init__(self, lang: str = "eng", psm: int = 3, thresholding: int = 2,
                 timeout_s: float = 10.0, demote_after_s: float = 0.5) -> None:
        self.lang = lang
        self.psm = psm
        self.thresholding = thresholding
        self.timeout_s = timeout_s
        self.demote_after_s = demote_after_s
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

    def read(self, image: Image.Image, cancel: threading.Event | None = None) -> str:
        """Cleaned text found in ``image`` ("" when there is none). Raises :class:`OCRError`;
        ``preempted`` when ``cancel`` is set before tesseract ends (it is then killed)."""
        if not self.available:
            raise OCRError("missing", self.unavailable_reason or "tesseract is not available")
        import pytesseract

        if image.mode not in ("L", "RGB"):
            image = image.convert("RGB")
        cmd = [pytesseract.pytesseract.tesseract_cmd]
        with tempfile.TemporaryDirectory(prefix="mrc-ocr-") as tmp:
            src = os.path.join(tmp, "in.png")
            image.save(src, format="PNG", compress_level=1)  # a local file: speed over size
            try:
                raw = self._run([*cmd, src, "stdout", "-l", self.lang, "--psm", str(self.psm),
                                 "-c", f"thresholding_method={self.thresholding}"], cancel)
            except OSError as e:  # the binary vanished since the availability check
                raise OCRError("failed", f"tesseract failed: {e}") from e
        return clean_text(raw)

    def _run(self, cmd: list[str], cancel: threading.Event | None) -> str:
        """tesseract's standard output; kills it on timeout or cancellation."""
        env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env)
        demoted = False
        try:
            while True:
                try:
                    out, err = proc.communicate(timeout=_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                ran = time.monotonic() - started
                if cancel is not None and cancel.is_set():
                    raise OCRError("preempted", f"cancelled after {ran:.2g}s to free its "
                                   "thread for another request")
                if ran > self.timeout_s:
                    raise OCRError("timeout", f"tesseract took longer than {self.timeout_s:g}s")
                if not demoted and ran > self.demote_after_s:
                    demoted = True
                    try:
                        os.setpriority(os.PRIO_PROCESS, proc.pid, DEMOTED_NICE)
                    except OSError as exc:  # it ended meanwhile, or a sandbox forbids it
                        log.debug("tesseract %d not demoted: %s", proc.pid, exc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if proc.returncode != 0:
            message = err.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
            raise OCRError("failed", f"tesseract failed (exit {proc.returncode}): "
                           f"{message[0][:200]}")
        return out.decode("utf-8", errors="replace")
