"""No import cycles among the project's modules (packages/*/src): a cycle is a loop in the design even when
a function-level import keeps it from failing at import time, so imports inside functions count as much
as those at module level. Imports under ``if TYPE_CHECKING:`` do not (they never run).

Checked on the sources with ``ast`` only, so it holds whatever is installed."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[1] / "packages"


def find_modules(packages: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``packages/*/src/**/*.py`` (a package by its ``__init__.py``)."""
    modules = {}
    for path in sorted(packages.glob("*/src/**/*.py")):
        src = next(p for p in path.parents if p.name == "src")
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported(path: Path, me: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` (module ``me``) imports, at module level or in functions, not under
    ``if TYPE_CHECKING:``; a name imported from a module is that module unless it is a submodule itself."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `.` is this package, each further dot one package up
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            subs = [f"{base}.{alias.name}" for alias in node.names]
            names = [n for n in subs if n in modules]
            if len(names) < len(subs):  # some names are attributes of `base` itself
                names.append(base)
        elif (  # importlib.import_module("a.b") / import_module("a.b:attr"), a literal: an edge like any import
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value.partition(":")[0]]
        for name in names:
            while name and name not in modules:  # `import a.b.c` of an attribute path: its nearest module
                name = name.rpartition(".")[0]
            if name and name != me:
                found.add(name)
    return found


def import_graph(packages: Path) -> dict[str, set[str]]:
    modules = find_modules(packages)
    return {name: imported(path, name, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:  # every edge of `node` followed: close it
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"    {a} imports {b}" for a in component for b in sorted(graph[a] & members)]
    return "cycle: " + " <-> ".join(component) + "\n" + "\n".join(edges)


def test_no_import_cycles():
    graph = import_graph(PACKAGES)
    assert len(graph) > 50, f"found only {len(graph)} modules under {PACKAGES}"
    found = cycles(graph)
    assert not found, f"{len(found)} import cycles:\n" + "\n".join(describe(c, graph) for c in found)


def test_the_scan_sees_cycles_through_every_import_form(tmp_path):
    src = tmp_path / "packages" / "primus-x" / "src" / "primus" / "x"
    (src / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from primus.x.b import thing\n",  # module level, absolute
        "b.py": "def f():\n    from . import c\n",  # in a function, relative submodule
        "c.py": "import primus.x.a.thing\n",  # an attribute path: its module
        "g.py": "import importlib\ndef f():\n    importlib.import_module('primus.x.h')\n",  # a string
        "h.py": "from primus.x.g import f\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from primus.x import e\n",
        "e.py": "from primus.x.d import y\n",  # d -> e is only under TYPE_CHECKING: no cycle
        "sub/__init__.py": "from ..sub.f import z\n",  # relative, two dots from a package's __init__
        "sub/f.py": "from primus.x.sub import w\n",
    }
    for name, text in files.items():
        (src / name).write_text(text)
    graph = import_graph(tmp_path / "packages")
    assert graph["primus.x.d"] == set()
    assert cycles(graph) == [
        ["primus.x.a", "primus.x.b", "primus.x.c"],
        ["primus.x.g", "primus.x.h"],
        ["primus.x.sub", "primus.x.sub.f"],
    ]
    assert cycles({"p": {"q"}, "q": {"r"}, "r": set(), "s": {"s"}}) == []  # a chain; a self-import is no cycle
