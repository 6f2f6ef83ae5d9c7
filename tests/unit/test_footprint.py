"""The sidecar stays light: importing every agent and exporter module pulls in neither torch
nor the GPU libraries (those load only when a GPU backend is used)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

from mrc_agent import agent, exporters
from tests.conftest import REPO


def test_no_heavy_imports() -> None:
    modules = [m.name for m in pkgutil.walk_packages(agent.__path__, "mrc_agent.agent.")
               if not m.name.endswith("__main__")]
    modules += [m.name for m in pkgutil.walk_packages(exporters.__path__, "mrc_agent.exporters.")]
    assert "mrc_agent.agent.core.hw.nvml" in modules and "mrc_agent.agent.tools.diagnose" in modules
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "bad = [m for m in ('torch', 'pynvml', 'cupti', 'numpy') if m in sys.modules]\n"
            "print(','.join(bad))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"heavy modules imported: {r.stdout}"
