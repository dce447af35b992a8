"""A real core run in process with core's stand-in engine (primus.core.run.testing), these two loggers registered, and nothing else: installed
plugins are not loaded (the run is the same whatever else is installed), W&B and MLflow write only under tmp_path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from primus.core.contracts.plugins import DISABLE_ENV, Registry
from primus.core.run.testing import registry as stand_in_registry
from primus.loggers import mlflow_logger, wandb_logger

pytest.importorskip("torch")  # core's run detects the device through torch


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    monkeypatch.setenv(DISABLE_ENV, "1")
    return stand_in_registry(("wandb", wandb_logger), ("mlflow", mlflow_logger))


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
    from primus.core.launch.rank import run_rank
    from primus.core.launch.resolve import resolve

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
