"""``--format png``: find headless Chromium, run it off the network in its own process group
to screenshot the HTML, and trim the blank bottom of the PNG (with Pillow, when installed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

#: Chromium's viewport width for ``--format png``; the page is laid out for it.
PAGE_WIDTH_PX = 1280


def find_chromium(explicit: str | None = None) -> str | None:
    """The Chromium (or Chrome) executable: ``explicit`` if given and runnable, else on PATH."""
    if explicit:
        found = shutil.which(explicit)
        return found
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def chromium_args(chromium: str, user_data_dir: str) -> list[str]:
    """Headless Chromium that stays off the network and keeps its state in ``user_data_dir``."""
    args = [chromium, "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--hide-scrollbars", "--force-device-scale-factor=1",
            f"--user-data-dir={user_data_dir}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--no-sandbox")  # Chromium refuses to run its sandbox as root
    return args


def screenshot(chromium: str, html_path: Path, png_path: Path, height: int,
               timeout_s: float = 60.0) -> None:
    """Render ``html_path`` to ``png_path`` with headless Chromium. Raises RuntimeError."""
    with tempfile.TemporaryDirectory(prefix="mrc-report-chromium-") as profile:
        cmd = [*chromium_args(chromium, profile), f"--window-size={PAGE_WIDTH_PX},{height}",
               f"--screenshot={png_path}", html_path.resolve().as_uri()]
        code, output = run_chromium(cmd, timeout_s)
        if code != 0 or not png_path.is_file() or png_path.stat().st_size == 0:
            tail = output.strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"Chromium exited {code} without a screenshot: {tail[0]}")
    _trim_bottom(png_path)


def run_chromium(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    """Run Chromium in its own process group, so that on a timeout its helpers (zygote,
    renderer) are killed with it; (exit code, stdout + stderr). Raises RuntimeError."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
    except OSError as exc:
        raise RuntimeError(f"cannot run {cmd[0]}: {exc}") from None
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"Chromium did not finish within {timeout_s:g} s") from None
    finally:
        # Gone already when Chromium exited cleanly with its helpers.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, out.decode(errors="replace")


def _trim_bottom(png_path: Path, margin: int = 24) -> None:
    """Cut the blank rows below the content (the viewport is an estimate). Needs Pillow."""
    try:
        from PIL import Image, ImageChops
    except ImportError:
        return
    with Image.open(png_path) as img:
        rgb = img.convert("RGB")
    bg = Image.new("RGB", rgb.size, rgb.getpixel((rgb.width - 1, rgb.height - 1)))
    box = ImageChops.difference(rgb, bg).getbbox()
    if box and box[3] + margin < rgb.height:
        rgb.crop((0, 0, rgb.width, box[3] + margin)).save(png_path)

