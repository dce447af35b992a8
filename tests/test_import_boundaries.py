"""Packages depend on primus-core only: core imports no plugin, no plugin imports another, and neither
backend imports the other's engine. Checked on the sources, so it holds whatever is installed.

(An engine imported by core or a non-backend plugin is not checked here: core's ``data prepare`` uses
megatron-core's dataset writer when it is installed, with a plain-numpy fallback.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import PACKAGES

ENGINES = {"megatron": "megatron", "torchtitan": "torchtitan"}  # backend subpackage -> engine top-level module


def imported_modules(path: Path) -> set[str]:
    """Absolute module names imported by a file, including ``importlib.import_module("...")`` with a literal."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(str(node.args[0].value))
    return names


def subpackages() -> dict[str, Path]:
    """``core`` -> packages/primus-core/src/primus/core, and so on for every in-tree package."""
    return {p.name: p for p in sorted(PACKAGES.glob("*/src/primus/*")) if p.is_dir() and p.name != "__pycache__"}


SUBPACKAGES = subpackages()


def test_the_namespace_has_no_init():
    assert SUBPACKAGES, "no packages found"
    for folder in SUBPACKAGES.values():
        assert not (folder.parent / "__init__.py").exists(), f"{folder.parent}/__init__.py breaks the namespace"


@pytest.mark.parametrize("name", sorted(SUBPACKAGES))
def test_imports_only_core_and_itself(name):
    others = {f"primus.{other}" for other in SUBPACKAGES if other not in (name, "core")}
    foreign_engines = {engine for backend, engine in ENGINES.items() if name in ENGINES and backend != name}
    bad = []
    for path in sorted(SUBPACKAGES[name].rglob("*.py")):
        for module in imported_modules(path):
            top = module.split(".")[0]
            if any(module == o or module.startswith(o + ".") for o in others) or top in foreign_engines:
                bad.append(f"{path.relative_to(PACKAGES)}: {module}")
    assert not bad, "\n".join(bad)


def test_the_scan_sees_every_import_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import primus.megatron\nfrom primus.torchtitan import x\nfrom primus import tune\n"
        "import importlib\nimportlib.import_module('torchtitan.train')\n"
    )
    assert {"primus.megatron", "primus.torchtitan", "primus.tune", "torchtitan.train"} <= imported_modules(src)
