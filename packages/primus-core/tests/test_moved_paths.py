"""Modules imported from their paths before core's rooms (``primus.core.protocols`` ...) still import: the same
module object as the new path, with a DeprecationWarning naming where it went."""

from __future__ import annotations

import importlib
import sys

import pytest

from primus.core._moved import MOVED


def test_every_old_path_gives_the_module_at_its_new_path():
    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
            module = importlib.import_module(old)
        assert module is importlib.import_module(new), old


def test_a_plugin_written_against_the_old_paths_still_works():
    sys.modules.pop("primus.core.protocols", None)
    with pytest.warns(DeprecationWarning):
        from primus.core.protocols import BackendSpec
    from primus.core.contracts.protocols import BackendSpec as New

    assert BackendSpec is New
