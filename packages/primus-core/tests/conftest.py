from __future__ import annotations

import pytest

from primus.core import hookimpl
from primus.core.contracts.engine import BackendSpec
from primus.core.contracts.plugins import DISABLE_ENV, Registry, build_plugin_manager
from primus.core.contracts.protocols import ConfigIssue


def _refuse_cp(cfg, world_size):
    if cfg.parallel.cp > 1:
        return [ConfigIssue("parallel.cp", "the fake engine has no context parallelism", value=cfg.parallel.cp)]
    return []


class FakeBackends:
    """A backend for config tests, so they need no engine installed."""

    @staticmethod
    @hookimpl
    def primus_backends():
        return [
            BackendSpec(
                name="fake",
                description="test backend",
                engine="primus.core.run.testing:StandInEngine",
                validate=_refuse_cp,
                model_families=frozenset({"llama", "qwen2", "qwen3", "mistral"}),
            )
        ]


@pytest.fixture
def registry(monkeypatch) -> Registry:
    """Core + the fake backend only, whatever else is installed in the environment."""
    monkeypatch.setenv(DISABLE_ENV, "1")
    return Registry(build_plugin_manager(extra_plugins=[("fake-backend", FakeBackends)]))


@pytest.fixture
def cli_registry(registry, monkeypatch) -> Registry:
    """Make the CLI's registry core + the fake backend (no engine needs to be installed)."""
    from primus.core.contracts import plugins

    monkeypatch.setattr(plugins, "_cached", registry)
    return registry
