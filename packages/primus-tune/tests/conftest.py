from __future__ import annotations

import pytest

from primus.core import hookimpl
from primus.core.contracts import plugins
from primus.core.contracts.engine import BackendSpec
from primus.core.contracts.plugins import Registry, build_plugin_manager


class EngineStandIn:
    """Registers the backend names the presets use, so config commands resolve without an engine installed
    (these tests look at config layering; nothing is trained)."""

    @staticmethod
    @hookimpl
    def primus_backends():
        return [
            BackendSpec(
                name=name, description="stand-in: config tests only", engine="primus.core.run.testing:StandInEngine"
            )
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


class FakeTunable:
    """Records the calls TunableOpSearcher makes; a tuning pass 'finds' the next queued result row."""

    def __init__(self, rows, with_write_file):
        self.calls: list[tuple] = []
        self.rows = list(rows)
        self.found: list[tuple] = []
        self.tuning = False
        if with_write_file:
            self.write_file = lambda: self.calls.append(("write_file",))

    def enable(self, on=True):
        self.calls.append(("enable", on))

    def tuning_enable(self, on=True):
        if on and not self.tuning and self.rows:
            self.found.append(self.rows.pop(0))
        self.tuning = on
        self.calls.append(("tuning_enable", on))

    def set_max_tuning_iterations(self, n):
        self.calls.append(("set_max_tuning_iterations", n))

    def set_filename(self, name, insert_device_ordinal=False):
        self.calls.append(("set_filename", name))

    def get_results(self):
        return tuple(self.found)

    def get_validators(self):
        return (("PT_VERSION", "2.11.0"), ("HIPBLASLT_VERSION", "1.0.0"))


@pytest.fixture
def fake_tunable() -> type:
    """A stand-in for ``torch.cuda.tunable`` (no ROCm here)."""
    return FakeTunable
