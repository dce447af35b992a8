"""Helpers shared by the cross-package tests (a plain module, so no other conftest.py can shadow it)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"


def in_tree_packages() -> list[dict]:
    """``[project]`` of every in-tree distribution (packages/*/pyproject.toml), plus its folder."""
    found = []
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        found.append({**project, "folder": pyproject.parent})
    return found


def primus(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the ``primus`` CLI of this environment in a fresh process."""
    proc = subprocess.run([sys.executable, "-m", "primus.core.cli.app", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        pytest.fail(f"primus {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def primus_commands(root: Path, commands: dict[str, list[str]], env: dict[str, str]) -> dict[str, dict]:
    """Run ``primus`` commands (name -> its arguments) one after another in one child process
    (tests/fixtures/primus_commands.py: an engine's import paid once), in ``root`` (an engine's build writes into the
    default output folder, outputs/<model>: there, not the tree); name -> ``{args, rc, out}``."""
    import json

    results = root / "results.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fixtures" / "primus_commands.py"), str(results),
         *map(json.dumps, commands.values())],
        capture_output=True, text=True, timeout=600, env=env, cwd=root,
    )  # fmt: skip
    if proc.returncode != 0 or not results.is_file():
        pytest.fail(f"primus_commands.py exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return dict(zip(commands, json.loads(results.read_text()), strict=True))


def ok(result: dict) -> str:
    """What a command (of :func:`primus_commands`) printed, whitespace folded; the test fails where it did not exit 0."""
    assert result["rc"] == 0, f"primus {' '.join(result['args'])} exited {result['rc']}:\n{result['out'][-4000:]}"
    return " ".join(result["out"].split())


def refused(result: dict) -> str:
    """The one line a refused command (of :func:`primus_commands`) printed (exit 2, no traceback)."""
    assert result["rc"] == 2, f"primus {' '.join(result['args'])} exited {result['rc']}:\n{result['out'][-4000:]}"
    errors = [line for line in result["out"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result["out"], result["out"]
    return errors[0]
