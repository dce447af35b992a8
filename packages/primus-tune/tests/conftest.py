from __future__ import annotations

import pytest

from primus.core import hookimpl, plugins
from primus.core.plugins import Registry, build_plugin_manager
from primus.core.protocols import BackendSpec


class EngineStandIn:
    """Registers the backend names the presets use, so config commands resolve without an engine installed
    (these tests look at config layering; nothing is trained)."""

    @staticmethod
    @hookimpl
    def primus_backends():
        return [
            BackendSpec(name=name, description="stand-in: config tests only", run="builtins:print")
            for name in ("torchtitan", "megatron")
        ]


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """Installed plugins (primus-core, primus-tune) plus the stand-in backends; the CLI uses this registry."""
    reg = Registry(build_plugin_manager(extra_plugins=[("engine-stand-in", EngineStandIn)]))
    monkeypatch.setattr(plugins, "_cached", reg)
    return reg


@pytest.fixture
def cache_home(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"
