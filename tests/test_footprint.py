"""The sidecar stays light: importing every agent and exporter module pulls in neither torch
nor the GPU libraries (those load only when a GPU backend is used)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import agent
import exporters
from tests.conftest import REPO


def test_no_heavy_imports() -> None:
    modules = [f"agent.{m.name}" for m in pkgutil.walk_packages(agent.__path__)
               if m.name not in ("__main__",)]
    modules += [f"agent.hw.{m}" for m in ("base", "procfs", "replay", "nvml", "cupti_pm")]
    modules += [f"exporters.{m.name}" for m in pkgutil.iter_modules(exporters.__path__)]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "bad = [m for m in ('torch', 'pynvml', 'cupti', 'numpy') if m in sys.modules]\n"
            "print(','.join(bad))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"heavy modules imported: {r.stdout}"
