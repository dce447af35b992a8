"""The loggers' config: off unless named under logging.loggers (core's schema takes the section), settings and a
missing library refused naming the key before anything is built, nothing logged on a rank other than 0, and
`primus --help` loading neither library."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys

import pytest

from primus.core.config.errors import ConfigError
from primus.core.config.schema import PrimusConfig
from primus.core.contracts.engine import RunInfo
from primus.core.launch.resolve import resolve
from primus.loggers import mlflow_logger, wandb_logger

LIBRARIES = {"wandb": "wandb", "mlflow": "mlflow"}


def test_core_schema_takes_logger_sections_off_by_default():
    assert PrimusConfig().logging.loggers == {}
    cfg = PrimusConfig.model_validate({"logging": {"loggers": {"wandb": {"project": "x"}, "mine": {}}}})
    assert cfg.logging.loggers == {"wandb": {"project": "x"}, "mine": {}}
    with pytest.raises(ConfigError) as err:
        resolve("tiny-llama", ["logging.loggers.wandb=3"], world_size=1, check_plugins=False)
    # a logger's settings are a mapping (core names the section: its key paths stop at a dict field's keys)
    assert err.value.paths == ["logging.loggers"] and "dictionary" in str(err.value)


@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_a_logger_without_its_library_is_refused_naming_the_key(name, registry, monkeypatch):
    monkeypatch.setitem(sys.modules, LIBRARIES[name], None)  # `import <library>` fails: as if not installed
    with pytest.raises(ConfigError) as err:
        resolve("tiny-llama", ["backend.name=stand-in", f"logging.loggers.{name}.enabled=true"], registry=registry)
    assert err.value.paths == [f"logging.loggers.{name}"]
    assert f"pip install 'primus-loggers[{name}]'" in str(err.value) and "not installed" in str(err.value)
    # turned off, it needs no library
    off = resolve("tiny-llama", ["backend.name=stand-in", f"logging.loggers.{name}.enabled=false"], registry=registry)
    assert off.config.logging.loggers == {name: {"enabled": False}}


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        ("logging.loggers.wandb.projct=x", "logging.loggers.wandb.projct", "did you mean 'project'"),
        ("logging.loggers.wandb.mode=sometimes", "logging.loggers.wandb.mode", "'online', 'offline' or 'disabled'"),
        ("logging.loggers.mlflow.tags=[a]", "logging.loggers.mlflow.tags", "dictionary"),
        ("logging.loggers.mlflow.experiment=[a]", "logging.loggers.mlflow.experiment", "string"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(override, key, words, registry):
    with pytest.raises(ConfigError) as err:
        resolve("tiny-llama", ["backend.name=stand-in", override], registry=registry)
    assert err.value.paths == [key] and words in str(err.value)


def test_nothing_is_logged_on_a_rank_other_than_0(tmp_path, registry):
    out, store = tmp_path / "run", tmp_path / "mlruns"
    on = ["logging.loggers.wandb.mode=offline", f"logging.loggers.mlflow.tracking_uri=file:{store}"]
    cfg = resolve("tiny-llama", [f"logging.output_dir={out}", *on], world_size=2, check_plugins=False).config
    info = RunInfo(world_size=2, rank=1, output_dir=str(out))
    hook = registry.pm.hook
    hook.primus_on_train_start(config=cfg, info=info)
    hook.primus_on_log(step=1, metrics={"loss": 1.0}, info=info)
    hook.primus_on_train_end(summary={"status": "ok"}, info=info)
    assert not out.exists() and not store.exists()  # no wandb folder, no run id, no MLflow store
    assert not wandb_logger._active and not mlflow_logger._active


def test_a_run_that_names_no_logger_logs_to_none(tmp_path, train):
    out = tmp_path / "run"
    assert train(out)["status"] == "ok"
    assert (out / "metrics.jsonl").exists()
    assert not (out / "wandb").exists() and not (out / "loggers").exists() and not (tmp_path / "mlruns").exists()


def loaded_after(code: str) -> dict[str, bool]:
    probe = (
        f"import sys\n{code}\n"
        "print({m: m in sys.modules for m in ('primus.loggers.wandb_logger', 'primus.loggers.mlflow_logger', "
        "'wandb', 'mlflow')})"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


def test_the_cli_loads_the_plugins_but_neither_library():
    names = {ep.name for ep in importlib.metadata.entry_points(group="primus") if ep.value.startswith("primus.loggers")}
    if names != {"wandb", "mlflow"}:
        pytest.skip("primus-loggers is not installed: its entry points are not there")
    code = (
        "from primus.core.cli import app as cli\n"
        "for argv in (['--help'], ['config', 'show', 'tiny-demo', 'logging.loggers.wandb.mode=offline', "
        "'logging.loggers.mlflow.experiment=x']):\n"
        "    sys.argv = ['primus', *argv]\n"
        "    try:\n        cli.main()\n    except SystemExit as e:\n        assert not e.code, e.code"
    )
    assert loaded_after(code) == {
        "primus.loggers.wandb_logger": True,
        "primus.loggers.mlflow_logger": True,
        "wandb": False,
        "mlflow": False,
    }
