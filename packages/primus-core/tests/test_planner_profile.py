"""One engine contract: core decides nothing by an engine's name. What the planner knows of an engine is the profile
its backend names (``BackendSpec(planner=...)``), looked up by the backend's name; core's code never names an engine.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from primus.core import hookimpl
from primus.core.contracts.engine import BackendSpec
from primus.core.contracts.plugins import Registry, build_plugin_manager
from primus.core.planner import GENERIC, EngineProfile, Layout, estimate, profile_of
from primus.core.planner.engine_profile import load_profile

CORE = Path(__file__).resolve().parents[1] / "src" / "primus" / "core"
ENGINE = re.compile(r"megatron|torchtitan", re.IGNORECASE)

# Where core's code may name an engine all the same, file (relative to primus/core) -> the exact words, with why.
# None of them is a decision the planner, the strategies or the kernel selection make.
ALLOWED: dict[str, set[str]] = {
    # "megatron" is also the name of a file format, Megatron's indexed dataset (.bin/.idx), which core reads and
    # writes itself (data.format; prepare's writer, megatron-core's own builder where it is installed): a format,
    # not the engine
    "config/schema.py": {"megatron", "torchtitan"},  # and the default backend.name, a value a config may set
    "config/validate.py": {"megatron"},  # data.format: megatron (evaluation of it is refused)
    "data/checks.py": {"megatron"},
    "data/documents.py": {"megatron"},
    "data/prepare.py": {"megatron", "_megatron_builder", "megatron.core.datasets.indexed_dataset"},
    "data/sources.py": {"megatron"},
    # `primus env` / preflight report the versions of the distributions installed, by their names (and `primus
    # presets list` shows a recipe without a backend under the schema's default backend.name)
    "cli/app.py": {"megatron-core", "torchtitan", "primus-megatron", "primus-torchtitan"},
    "launch/preflight.py": {"megatron-core", "torchtitan", "primus-megatron", "primus-torchtitan"},
    # "backend 'x' is not installed: pip install primus-x": which distribution provides an in-tree backend
    "contracts/plugins.py": {"megatron", "primus-megatron", "torchtitan", "primus-torchtitan"},
}


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, nodes)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }


def _words(tree: ast.AST) -> list[tuple[int, str]]:
    """The words of a module's code: every identifier (names, attributes, definitions, arguments, keywords, imports)
    and every string literal, but docstrings and prose (a literal, or an f-string's text taken whole, with
    whitespace in it: a message, help or description said to a person, never a key or a value compared)."""
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if re.search(r"\s", text):
                skip |= {id(v) for v in node.values}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in skip and not re.search(r"\s", node.value):
                found.append((line, node.value))
        elif isinstance(node, ast.Name):
            found.append((line, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((line, node.attr))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.append((line, node.name))
        elif isinstance(node, ast.arg | ast.keyword) and node.arg:
            found.append((line, node.arg))
        elif isinstance(node, ast.alias):
            found += [(line, node.name), (line, node.asname or "")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((line, node.module))
    return found


def _yaml_strings(data: object, path: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    if isinstance(data, dict):
        return [s for k, v in data.items() for s in [(".".join(path), str(k)), *_yaml_strings(v, (*path, str(k)))]]
    if isinstance(data, list):
        return [s for v in data for s in _yaml_strings(v, path)]
    return [(".".join(path), data)] if isinstance(data, str) else []


def test_core_names_no_engine():
    """The rule, on every file of primus-core's sources (contents only; a preset's file name may say which engine
    its recipe is for):

    - Python: an engine's name ("megatron", "torchtitan", any case, inside a word too) may appear in comments,
      docstrings and prose (a string literal with whitespace in it), never in an identifier or a word-like string
      literal (a key, a compared value, a default), but for the words ``ALLOWED`` lists per file, with why.
    - Presets (YAML): only as the value of ``backend.name`` (a recipe is written for a backend) and in
      ``description``; comments are free. ``presets/renamed.yaml`` maps preset names (file names) to preset names.
    - Any other file: nowhere.
    """
    found = []
    for path in sorted(CORE.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(CORE).as_posix()
        if rel == "presets/renamed.yaml":
            # names only: each one a recipe file's
            assert all(
                (path.parent / "recipes" / f"{n}.yaml").is_file() for n in yaml.safe_load(path.read_text()).values()
            )
            continue
        if path.suffix == ".py":
            allowed = ALLOWED.get(rel, set())
            found += [
                f"{rel}:{line}: {word!r}"
                for line, word in _words(ast.parse(path.read_text(), rel))
                if ENGINE.search(word) and word not in allowed
            ]
        elif path.suffix in (".yaml", ".yml"):
            found += [
                f"{rel}: {key or '(top)'}: {text!r}"
                for key, text in _yaml_strings(yaml.safe_load(path.read_text()))
                if ENGINE.search(text) and key not in ("backend.name", "description")
            ]
        elif ENGINE.search(path.read_text(errors="replace")):
            found.append(rel)
    assert not found, "core names an engine:\n" + "\n".join(found)


def test_the_rule_catches_a_decision_by_name():
    code = 'if cfg.backend.name == "torchtitan":\n    x = SELECTIVE_KEPT["megatron"]\nmsg = "torchtitan can not"\n'
    words = [w for _, w in _words(ast.parse(code)) if ENGINE.search(w)]
    assert words == ["torchtitan", "megatron"]  # the prose is free


# ------------------------------------------------------------------------------------------------ lookup

MINE = EngineProfile(name="mine", weight_bytes=4, master_bytes=0, selective_kept=0.5)


def _registry(**planners) -> Registry:
    class Backends:
        @staticmethod
        @hookimpl
        def primus_backends():
            return [
                BackendSpec(name, "", engine="primus.core.run.testing:StandInEngine", planner=p)
                for name, p in planners.items()
            ]

    return Registry(build_plugin_manager(extra_plugins=[("backends", Backends)]))


def test_a_backend_gives_its_profile(monkeypatch):
    monkeypatch.setenv("PRIMUS_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = _registry(mine=MINE, made=lambda: MINE, named="test_planner_profile:MINE", silent=None)
    assert profile_of("mine", reg) is MINE and profile_of("made", reg) is MINE and profile_of("named", reg) is MINE
    assert profile_of("silent", reg) is GENERIC  # a backend without planner=: the generic engine
    assert profile_of("no-such-backend", reg) is GENERIC
    assert profile_of(MINE) is MINE


def test_a_broken_profile_names_its_backend():
    with pytest.raises(TypeError, match=r"backend 'bad' \(\?\): planner=.* gives a dict"):
        load_profile(
            BackendSpec("bad", "", engine="primus.core.run.testing:StandInEngine", planner=lambda: {}, dist="?")
        )


def test_the_planner_counts_what_the_profile_says(registry):
    from primus.core.config.loader import load_layers
    from primus.core.config.presets import resolver
    from primus.core.config.schema import ModelConfig
    from primus.core.planner.modelmath import count_params

    m = ModelConfig.model_validate(load_layers("llama3.2-1b", resolve_preset=resolver(registry)).data["model"])
    p = count_params(m).total
    mine = estimate(m, Layout("mine", "ddp", dp=1, recompute="selective", profile=MINE), 4096).parts
    generic = estimate(m, Layout("mine", "ddp", dp=1, recompute="selective", profile=GENERIC), 4096).parts
    assert (mine["weights"], mine["optimizer"]) == (4 * p, 8 * p)
    assert (generic["weights"], generic["gradients"], generic["optimizer"]) == (2 * p, 4 * p, 12 * p)
    assert mine["activations"] < generic["activations"]  # selective keeps half
