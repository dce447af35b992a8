"""A package's re-exports imported on first use (PEP 562), so that importing one of its modules does not import
them all: ``primus.core.planner.modelmath`` alone is two files, not the whole planner."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, **modules: str) -> tuple[list[str], Callable[[str], Any]]:
    """``__all__`` and ``__getattr__`` of ``package`` (its ``__name__``): each submodule's names (``hardware="Device
    device"``, space-separated) taken from it on first use."""
    names = {name: module for module, listed in modules.items() for name in listed.split()}

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{names[name]}"), name)

    return sorted(names), __getattr__
