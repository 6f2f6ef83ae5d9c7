"""Docstring cross-references name real modules and objects, by the names the project installs.

A reference such as ``:class:`~mrc_agent.agent.core.hw.base.SourceUnavailable``` must resolve
by import and attribute lookup (a dataclass field counts), and none may use the bare folder
names (``agent.core...``), which exist only as a checkout's directories, never as installed
modules.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

from tests.conftest import REPO

ROOTS = ("agent", "exporters", "reference_service", "dashboards", "alerts", "tests",
         "benchmarks")
_ROLE = r":(?:class|func|mod|data|meth|attr|exc|obj):`~?"
INSTALLED = re.compile(_ROLE + r"(mrc_agent\.[A-Za-z0-9_.]+)`")
BARE = re.compile(_ROLE + r"((?:agent|exporters|reference_service|dashboards|alerts)\.[\w.]+)`")


def _sources() -> list[Path]:
    return [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))]


def _resolves(dotted: str) -> bool:
    parts = dotted.rstrip(".").split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            fields = getattr(obj, "__dataclass_fields__", {})
            if not hasattr(obj, name):
                # A dataclass or annotated field has no class attribute: nothing further.
                return name in fields or name in getattr(obj, "__annotations__", {})
            obj = getattr(obj, name)
        return True
    return False


def test_every_cross_reference_resolves_by_its_installed_name() -> None:
    found, broken = 0, []
    for path in _sources():
        for match in INSTALLED.finditer(path.read_text()):
            found += 1
            if not _resolves(match.group(1)):
                broken.append(f"{path.relative_to(REPO)}: {match.group(0)}")
    assert found > 100  # the references are there to check
    assert broken == []


def test_no_cross_reference_uses_a_bare_folder_name() -> None:
    bare = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in _sources()
            for m in BARE.finditer(p.read_text())]
    assert bare == []


def test_the_resolver_tells_a_real_name_from_a_misspelt_one() -> None:
    assert _resolves("mrc_agent.agent.core.hw.base.SourceUnavailable")
    assert _resolves("mrc_agent.agent.core.hw.nvml.pcie_counters")
    assert not _resolves("mrc_agent.agent.core.hw.base.SourceUnavailabel")
    assert not _resolves("mrc_agent.agent.core.hw.no_such_module.Thing")
