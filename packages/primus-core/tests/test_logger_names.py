"""``logging.loggers`` names installed loggers only: a plugin that is no logger (a backend) is refused, and the
refusal lists the loggers installed here, a third-party one included, and none that are not."""

from __future__ import annotations

import types

import pytest

from primus.core import hookimpl
from primus.core.config.errors import ConfigError
from primus.core.contracts.plugins import DISABLE_ENV
from primus.core.launch.resolve import resolve
from primus.core.run.testing import registry as stand_in_registry


def _logger_module() -> types.ModuleType:
    mod = types.ModuleType("my_tracker_plugin")

    @hookimpl
    def primus_on_log(step, metrics, info):  # noqa: ARG001
        pass

    mod.primus_on_log = primus_on_log
    return mod


@pytest.fixture
def reg(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    kernels_only = types.ModuleType("kernels_only")
    kernels_only.primus_kernels = hookimpl(lambda: [])
    return stand_in_registry(("mytracker", _logger_module()), ("fastkernels", kernels_only))


def _refusal(reg, override: str) -> str:
    with pytest.raises(ConfigError) as err:
        resolve("tiny-llama", ["backend.name=stand-in", override], world_size=1, registry=reg)
    assert err.value.paths == [override.split("=")[0].rsplit(".", 1)[0]]
    return str(err.value)


def test_installed_loggers_are_the_plugins_with_primus_on_log(reg):
    assert reg.loggers == ["mytracker"]  # core's console logger is always on, and no name to turn on
    assert reg.pm.records["mytracker"].provides == {"loggers": ["mytracker"]}
    ok = resolve("tiny-llama", ["backend.name=stand-in", "logging.loggers.mytracker.x=1"], world_size=1, registry=reg)
    assert ok.config.logging.loggers == {"mytracker": {"x": 1}}


def test_a_plugin_that_is_no_logger_is_refused(reg):
    text = _refusal(reg, "logging.loggers.fastkernels.project=x")
    assert "plugin 'fastkernels'" in text and "is not a logger" in text and "allowed: mytracker" in text


def test_an_unknown_logger_lists_only_installed_ones(reg):
    text = _refusal(reg, "logging.loggers.mytrackr.project=x")
    assert "did you mean 'mytracker'" in text and "allowed: mytracker" in text and "mlflow" not in text
    text = _refusal(reg, "logging.loggers.wandb.project=x")  # primus-loggers is not loaded here: the hint says how
    assert "pip install 'primus-loggers[wandb]'" in text and "allowed: mytracker" in text
