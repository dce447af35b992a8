"""The cross-package tests never import an engine in the pytest process: torchtitan picks its device at import
("cuda" on a CPU build), so a test that imported it first left the next test on the same xdist worker refused
("torchtitan was imported before primus.torchtitan could select the CPU"). Engines run in child processes, or
through primus.torchtitan / primus.megatron, which select the device before their engine's first import."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINES = ("torchtitan", "megatron")
TESTS = Path(__file__).parent


def engine_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of each import of an engine in ``source``: ``import`` / ``from`` statements anywhere (module
    level or inside a function) and ``importorskip`` / ``import_module`` of a literal; code in strings (run in a
    child process) is not an import."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("importorskip", "import_module"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [(node.lineno, n) for n in names if n.split(".")[0] in ENGINES]
    return found


def test_no_test_module_imports_an_engine():
    found = {p.name: hits for p in sorted(TESTS.glob("*.py")) if (hits := engine_imports(p.read_text()))}
    assert found == {}, found


def test_the_check_sees_every_form_and_leaves_strings_alone():
    source = (
        "import torchtitan.train\nfrom megatron.core import x\nimport pytest\n"
        "def f():\n    pytest.importorskip('torchtitan')\n    import importlib; importlib.import_module('megatron')\n"
        "CHILD = 'import torchtitan'\nfrom primus.torchtitan import compat\n"
    )
    assert engine_imports(source) == [(1, "torchtitan.train"), (2, "megatron.core"), (5, "torchtitan"), (6, "megatron")]
