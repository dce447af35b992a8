"""A real core run in process with a stand-in engine, these two loggers registered, and nothing else: installed
plugins are not loaded (the run is the same whatever else is installed), W&B and MLflow write only under tmp_path."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from primus.core import hookimpl
from primus.core.loop import StepResult
from primus.core.plugins import DISABLE_ENV, Registry, build_plugin_manager
from primus.core.protocols import BackendSpec
from primus.loggers import mlflow_logger, wandb_logger

pytest.importorskip("torch")  # core's run detects the device through torch


class StandInEngine:
    """Loss 10/step; ``backend.extra.signal_at`` stops the run there (SIGUSR1), ``fail_at`` raises there."""

    layout = {"world": 1}
    distributions = ("primus-core",)

    def __init__(self, cfg, ctx) -> None:
        self.model_parts, self.step = [], 0
        self.signal_at = cfg.backend.extra.get("signal_at")
        self.fail_at = cfg.backend.extra.get("fail_at")

    def train_step(self, step, lr, gate):
        if step == self.fail_at:
            raise RuntimeError(f"engine failed at step {step}")
        if step == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)  # the step still completes, then the run stops with a checkpoint
        self.step = step
        gate(10.0 / step, 1.0)
        return StepResult(loss=10.0 / step, grad_norm=1.0)

    def evaluate(self, samples, batches):
        return 2.0 + 1.0 / self.step

    def save(self, folder: Path) -> None:
        (folder / "state.json").write_text(json.dumps({"step": self.step}))

    def load(self, folder: Path) -> None:
        self.step = json.loads((folder / "state.json").read_text())["step"]

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class Backends:
    @staticmethod
    @hookimpl
    def primus_backends():
        return [BackendSpec("stand-in", "", engine=StandInEngine)]


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    monkeypatch.setenv(DISABLE_ENV, "1")
    plugins = [("backends", Backends), ("wandb", wandb_logger), ("mlflow", mlflow_logger)]
    return Registry(build_plugin_manager(extra_plugins=plugins))


@pytest.fixture(autouse=True)
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B offline and quiet, its settings and caches under tmp_path; no MLflow settings from the environment; no
    logger run of an earlier test left open."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # unset (and unset again after the test): the MLflow logger itself allows the file store a file: URI names
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    for module in (wandb_logger, mlflow_logger):
        assert not module._active, f"{module.__name__}: a run of an earlier test is still open"


@pytest.fixture
def train(registry: Registry) -> Callable[..., dict]:
    """``train(out, *overrides)``: one run of 8 steps into ``out`` (metrics every 3 steps and at the last)."""
    from primus.core.train import resolve, run_rank

    def run(out: Path, *overrides: str) -> dict:
        base = [
            "backend.name=stand-in",
            f"logging.output_dir={out}",
            "logging.tensorboard=false",
            "logging.progress=false",
            "logging.interval=3",
            "train.steps=8",
        ]
        return run_rank(resolve("tiny-llama", [*base, *overrides], world_size=1, registry=registry))

    return run
