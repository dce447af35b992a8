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
