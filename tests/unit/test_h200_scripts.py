"""The device check's two scripts agree: every distribution ``benchmarks/h200_check.sh``
installs from ``.whl`` is pinned in ``benchmarks/h200_prepare.sh`` (or, for the project, built
there), and the check installs them into a virtual environment, not with ``--target`` /
``PYTHONPATH`` (cupti-python finds libcupti through cuda-pathfinder, which ignores
``PYTHONPATH``)."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _array(script: str, name: str) -> list[str]:
    match = re.search(rf"^{name}=\(([^)]*)\)", script, re.M)
    assert match, f"no {name}=(...) in the script"
    return [w for line in match.group(1).splitlines()
            for w in line.split("#", 1)[0].split()]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_prepare_downloads_every_wheel_check_installs() -> None:
    check = (BENCH / "h200_check.sh").read_text()
    prepare = (BENCH / "h200_prepare.sh").read_text()
    required = {_norm(n) for n in _array(check, "REQUIRED")}
    pins = dict(p.split("==") for p in _array(prepare, "PINS"))
    pinned = {_norm(n) for n in pins}
    assert {"cupti-python", "nvidia-cuda-cupti", "cuda-bindings", "cuda-pathfinder",
            "nvidia-ml-py", "mrc-agent"} <= required
    assert required - {"mrc-agent"} <= pinned, required - pinned
    assert all(re.fullmatch(r"[0-9][0-9.]*", v) for v in pins.values()), pins
    assert "pip wheel" in prepare  # the project's own wheel
    assert '"${PINS[@]}"' in prepare and ".whl/PINS" in prepare


def test_check_installs_into_a_venv_and_proves_libcupti() -> None:
    check = (BENCH / "h200_check.sh").read_text()
    assert "--target" not in check and "PYTHONPATH" not in check
    assert "venv" in check and 'load_nvidia_dynamic_lib("cupti")' in check
    assert "benchmarks/gpu_truth.py" in check and "$OUT" in check
