"""The patch table every backend keeps in its compat module: each patch or private override it makes on its engine,
what it replaces, why, and the tests that fail when the engine changes under it (the project's rule: patches are a
last resort, one small named function per engine behaviour, each listed and tested). No torch import."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import NamedTuple


class Patch(NamedTuple):
    name: str  # where it lives (module.function, or Class.method for an override)
    patches: str  # the engine attribute / method it replaces or overrides
    why: str
    test: str  # tests (tests/<file>::<function>, comma-separated) that fail when the engine changes under it


def table_problems(compat: ModuleType, tests: Path, exempt: tuple[str, ...] = ()) -> list[str]:
    """What is wrong with ``compat.PATCHES``: a patch without a test, a named test that does not exist in
    ``tests``, a function or class ``compat`` defines that no patch names (``exempt``: the module's own
    non-patch helpers, such as a version check)."""
    problems = []
    for patch in compat.PATCHES:
        refs = [ref.strip() for ref in patch.test.split(",") if ref.strip()]
        if not refs:
            problems.append(f"{patch.name}: no test")
        for ref in refs:
            file, _, fn = ref.partition("::")
            if not (tests / file).is_file() or f"def {fn}(" not in (tests / file).read_text():
                problems.append(f"{patch.name}: {ref} does not exist")
    named = " ".join(p.name for p in compat.PATCHES)
    for name, obj in vars(compat).items():
        own = (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == compat.__name__
        if own and name not in exempt and not re.search(rf"\b{name}\b", named):
            problems.append(f"{compat.__name__}.{name} is not in PATCHES")
    return problems
