"""The house's rooms hold: which code runs inside ``mrc-agent run`` is visible from the folders,
imports run one way, no module imports itself back, and no hand-written module grows past the
size at which it is usually two.

Imports are read from the source (every ``import`` statement, including those inside
functions), so a lazy import counts as much as a top-level one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("agent", "exporters", "dashboards", "alerts", "reference_service")
MAX_LINES = 700


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(["mrc_agent", *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Modules of this repository that ``name`` imports, resolved to module names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports mod (the package comes first, as for any
            # submodule); ``from mod import name`` imports mod.
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _reaches(start: str, prefix: str) -> list[str]:
    return sorted(m for m in GRAPH[start] if m == prefix or m.startswith(prefix + "."))


def test_the_rooms_exist() -> None:
    for room in ("mrc_agent.agent.core", "mrc_agent.agent.core.collectors",
                 "mrc_agent.agent.core.hw", "mrc_agent.agent.tools",
                 "mrc_agent.exporters.exposition", "mrc_agent.exporters.instrumentation"):
        assert room in MODULES, room
        assert ast.get_docstring(ast.parse(MODULES[room].read_text())), f"{room} has no docstring"


def test_the_core_never_imports_a_tool() -> None:
    bad = {m: _reaches(m, "mrc_agent.agent.tools")
           for m in GRAPH if m.startswith("mrc_agent.agent.core")}
    assert not {m: t for m, t in bad.items() if t}


def test_exporters_and_the_service_never_import_the_agent() -> None:
    for module in GRAPH:
        if module.startswith(("mrc_agent.exporters", "mrc_agent.reference_service")):
            assert not _reaches(module, "mrc_agent.agent"), module
        if module.startswith("mrc_agent.exporters.exposition"):
            assert not _reaches(module, "mrc_agent.exporters.instrumentation"), module
        if module.startswith("mrc_agent.exporters.instrumentation"):
            assert not _reaches(module, "mrc_agent.exporters.exposition"), module


def test_no_import_cycle() -> None:
    # Tarjan's strongly connected components over the import graph.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert cycles == []


def test_cycle_detection_sees_a_lazy_import(tmp_path: Path) -> None:
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from mrc_agent.agent.cli import main\n")
    assert "mrc_agent.agent.cli" in _imports("mrc_agent.agent.fake", a)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_is_small_and_says_what_it_is_for(module: str) -> None:
    text = MODULES[module].read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"{module}: split it by concern"
    if text.strip():
        assert ast.get_docstring(ast.parse(text)), f"{module} has no module docstring"


@pytest.mark.parametrize("folder", ["tests", "benchmarks"])
def test_test_and_benchmark_modules_are_small_too(folder: str) -> None:
    """The size rule holds for the tests and benchmarks as for the code: a module past it is
    two concerns, and a test file grown by appending hides what it covers."""
    big = {str(p.relative_to(REPO)): n for p in sorted((REPO / folder).rglob("*.py"))
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}, "split them by concern"


def test_no_two_public_classes_share_a_name() -> None:
    where: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(module)
    assert {name: mods for name, mods in where.items() if len(mods) > 1} == {}


_PRIVATE = re.compile(r"\b(10\.\d+\.\d+\.\d+|192\.168\.\d+\.\d+|172\.(1[6-9]|2\d|3[01])\.\d+\.\d+|"
                      r"169\.254\.\d+\.\d+)\b|\[?fe80:")


def test_tests_naming_private_addresses_run_in_a_namespace() -> None:
    """A test module that names a private or link-local address marks those tests ``netns``
    (.ci/check's netns stage, which .ci/run runs, runs them under unshare -n, with loopback
    alone)."""
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name == "test_layout.py":
            continue
        text = path.read_text()
        if _PRIVATE.search(text):
            assert "pytest.mark.netns" in text, f"{path.name} names a private address"
    assert "unshare -n" in (REPO / ".ci" / "check").read_text()
    assert ".ci/check" in (REPO / ".ci" / "run").read_text()


def test_every_benchmark_imports_as_its_script_runs() -> None:
    """Each benchmark imports the project as installed (no path of its own) and its
    neighbours from its folder, as ``python benchmarks/NAME.py`` runs it: one that names a
    moved helper fails here, not on the day someone reruns it."""
    import subprocess
    import sys

    names = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py"))
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    res = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO / "benchmarks",
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    for path in [*(REPO / "benchmarks").glob("*.py"), *(REPO / "tests").rglob("*.py")]:
        assert not re.search(r"sys\.path\.(insert|append)\(", path.read_text()), path


#: What puts a test in a higher tier: a server or a program of another started by the test.
_STARTS_A_PROCESS = re.compile(r"subprocess\.Popen|uvicorn\.(run|Server)|ThreadingHTTPServer|"
                               r"asyncio\.start_server|agent_factory|Service\(")
_STARTS_PROMETHEUS = re.compile(r"\b(Prometheus|Alertmanager)\(")


def test_the_tests_lie_in_their_tiers() -> None:
    """Every test module is in one of three folders, by what it needs (docs/testing.md): no
    unit test starts a server or another program, and only the end-to-end tier starts a
    Prometheus or an Alertmanager."""
    tests = REPO / "tests"
    assert sorted(p.name for p in tests.glob("test_*.py")) == [], "put it in a tier's folder"
    tiers = {t: sorted((tests / t).glob("test_*.py")) for t in ("unit", "integration", "e2e")}
    assert all(tiers.values())
    assert sorted(p.name for p in tests.rglob("test_*.py")) == sorted(
        p.name for files in tiers.values() for p in files)
    for path in [p for p in tiers["unit"] if p.name != "test_layout.py"]:
        assert not _STARTS_A_PROCESS.search(path.read_text()), f"{path.name}: integration"
    for path in [p for p in tiers["unit"] + tiers["integration"] if p.name != "test_layout.py"]:
        assert not _STARTS_PROMETHEUS.search(path.read_text()), f"{path.name}: e2e"
    assert _STARTS_PROMETHEUS.search((tests / "e2e" / "test_e2e.py").read_text())
