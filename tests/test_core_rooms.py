"""primus-core's rooms import one way: each room imports only rooms below it (and itself). Edges are every import
the cycle test sees: module level, inside functions, and ``importlib.import_module`` of a literal.

Top to bottom: builtin (core's own plugin) > cli > launch > run > planner > hf > kernels > data > profile > config
> contracts (and the package root ``primus.core``: ``hookimpl``)."""

from __future__ import annotations

from pathlib import Path

from test_import_cycles import PACKAGES, import_graph

ROOMS = ["builtin", "cli", "launch", "run", "planner", "hf", "kernels", "data", "profile", "config", "contracts"]
BOTTOM = {""}  # primus.core itself: below every room

# Upward edges still there, each to go (a new one fails the test; one gone must be taken off this list).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def room(module: str) -> int | None:
    if module != "primus.core" and not module.startswith("primus.core."):
        return None
    first = module.removeprefix("primus.core").lstrip(".").split(".")[0]
    return len(ROOMS) if first in BOTTOM else ROOMS.index(first)


def upward_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {
        (a, b)
        for a, targets in graph.items()
        if room(a) is not None
        for b in targets
        if room(b) is not None and room(b) < room(a)
    }


def test_every_core_module_is_in_a_room():
    graph = import_graph(PACKAGES)
    core = [m for m in graph if room(m) is not None]
    assert len(core) > 80, len(core)


def test_rooms_import_only_downwards():
    found = upward_edges(import_graph(PACKAGES))
    assert found - KNOWN_UPWARD == set(), "upward imports:\n" + "\n".join(sorted(f"{a} -> {b}" for a, b in found))
    assert KNOWN_UPWARD - found == set(), "gone (take them off KNOWN_UPWARD): " + repr(KNOWN_UPWARD - found)


def test_an_upward_import_fails(tmp_path: Path):
    core = tmp_path / "packages" / "primus-core" / "src" / "primus" / "core"
    for room_name in ("run", "planner", "contracts"):
        (core / room_name).mkdir(parents=True)
        (core / room_name / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "run" / "loop.py").write_text("from primus.core.planner.plan import x\n")  # downwards: fine
    (core / "planner" / "plan.py").write_text(
        "def f():\n    import importlib\n    importlib.import_module('primus.core.run.loop')\n"
    )
    (core / "contracts" / "plugins.py").write_text("def g():\n    from primus.core.planner import plan\n")
    assert upward_edges(import_graph(tmp_path / "packages")) == {
        ("primus.core.planner.plan", "primus.core.run.loop"),
        ("primus.core.contracts.plugins", "primus.core.planner.plan"),
    }
