"""The repository's folders install under one namespace, ``mrc_agent``, and nothing imports
them by a bare top-level name (which would work in a checkout and fail in the wheel).

The wheel itself is built and installed beside a distribution that claims the generic names
by ``.ci/package``; these tests keep the declaration in ``pyproject.toml`` equal to the tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

from tests.conftest import REPO

FOLDERS = ("agent", "exporters", "alerts", "dashboards", "reference_service")
ROOT = REPO / ".ci" / "namespace"  # the import root: mrc_agent/<folder> links
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _tree_packages() -> set[str]:
    found = set()
    for folder in FOLDERS:
        for init in (REPO / folder).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                parts = init.parent.relative_to(REPO).parts
                found.add(".".join(("mrc_agent", *parts)))
    return found


def test_every_package_of_the_tree_is_declared_and_nothing_else() -> None:
    # mrc_agent, the namespace, is declared so that setuptools sees one import root
    declared = set(SETUPTOOLS["packages"]) - {"mrc_agent"}
    tree = _tree_packages()
    assert tree - declared == set(), "add these to [tool.setuptools] packages"
    assert declared - tree == set(), "declared but not in the tree"


def test_each_folder_maps_to_its_namespace_name() -> None:
    # One import root, whose mrc_agent/ links each folder under its namespace name: setuptools
    # then installs the checkout editable as a plain path entry (no import hook).
    assert SETUPTOOLS["package-dir"] == {"": ".ci/namespace"}
    assert "mrc_agent" in SETUPTOOLS["packages"]
    assert not (ROOT / "mrc_agent" / "__init__.py").exists()  # a namespace package
    assert PYPROJECT["project"]["scripts"] == {"mrc-agent": "mrc_agent.agent.cli:main"}
    for key in SETUPTOOLS["package-data"]:
        assert key in SETUPTOOLS["packages"], key


def test_the_import_root_links_each_folder() -> None:
    links = ROOT / "mrc_agent"
    assert sorted(p.name for p in links.iterdir()) == sorted(FOLDERS)
    for folder in FOLDERS:
        assert (links / folder).is_symlink()
        assert (links / folder).resolve() == (REPO / folder).resolve()
    assert PYPROJECT["tool"]["mypy"]["mypy_path"] == ".ci/namespace"


def test_an_editable_install_is_a_path_entry_to_the_import_root() -> None:
    """`pip install -e .` (the README's step, .ci/provision's) writes a ``.pth`` naming the
    import root, which static analysers and editors follow, and no import-hook finder, which
    they cannot. Skipped only where mrc-agent is not installed editable from this checkout."""
    import importlib.metadata as md
    import json

    dist = md.distribution("mrc-agent")
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    if not url.get("dir_info", {}).get("editable"):
        pytest.skip("mrc-agent is not installed editable here")
    files = [str(f) for f in dist.files or []]
    assert not [f for f in files if "finder" in f], files
    pth = [f for f in files if f.endswith(".pth")]
    assert len(pth) == 1, files
    entries = dist.locate_file(pth[0]).read_text().split()
    if Path(entries[0]).resolve() != ROOT.resolve():
        pytest.skip(f"installed editable from another checkout: {entries[0]}")
    assert entries == [entries[0]] and not entries[0].startswith("import")


def _python_files() -> list[Path]:
    files = []
    for top in (*FOLDERS, "tests", "benchmarks"):
        files += [p for p in sorted((REPO / top).rglob("*.py")) if "__pycache__" not in p.parts]
    files.append(REPO / ".ci" / "mutation")
    return files


def _bare_imports(path: Path, root: Path = REPO) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        bad += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names
                if n.split(".")[0] in FOLDERS]
    return bad


def test_nothing_imports_a_folder_by_its_bare_name() -> None:
    bad = [line for path in _python_files() for line in _bare_imports(path)]
    assert bad == []


@pytest.mark.parametrize("source, found", [
    ("from agent.core import run\n", True),
    ("import exporters.instrumentation\n", True),
    ("def f():\n    import alerts\n", True),
    ("from mrc_agent.agent.core import run\n", False),
    ("from . import sibling\n", False),
    ("import agentless\n", False),
])
def test_the_bare_import_check_sees_them(tmp_path: Path, source: str, found: bool) -> None:
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert bool(_bare_imports(path, tmp_path)) is found
