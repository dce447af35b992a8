"""The ``tune`` entry point: tuned recipes, a default GEMM results file, and the ``tune`` / ``benchmark`` commands."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from primus.core import hookimpl
from primus.tune.gemm import default_results_file

PRESETS_DIR = Path(__file__).parent / "presets"
log = logging.getLogger("primus.tune")

# the GEMM tuning of this process's run (one run per process), between model_ready and train_end
_active: dict[str, Any] = {}


@hookimpl
def primus_presets() -> list[Path]:
    return [PRESETS_DIR]


@hookimpl
def primus_commands() -> list[tuple[str, Any]]:
    from primus.tune.commands import benchmark_app, tune_app  # typer only; torch is imported inside the commands

    return [("tune", tune_app), ("benchmark", benchmark_app)]


@hookimpl
def primus_configure(config: dict[str, Any]) -> dict[str, Any] | None:
    """``kernels.gemm_tuning: offline`` (read) or ``online`` (written at the end) without a ``gemm_tuning_file``:
    use the per-model default file."""
    kernels = config.get("kernels") or {}
    if kernels.get("gemm_tuning") not in ("offline", "online") or kernels.get("gemm_tuning_file"):
        return None
    return {"kernels.gemm_tuning_file": str(default_results_file(config))}


@hookimpl
def primus_check_run(config: Any) -> list[Any]:
    """GEMM tuning this machine cannot run (on a CPU; an offline file missing or refused), before anything is
    written. Imports torch only when tuning is on."""
    if config.kernels.gemm_tuning == "off":
        return []
    from primus.core.kernels.selection import detect_device
    from primus.tune.runtime import run_issues

    return run_issues(config, detect_device())


@hookimpl
def primus_on_model_ready(config: Any, model_parts: list[Any], info: Any) -> None:
    """``kernels.gemm_tuning`` online/offline: set tuning up for this run and route the model's linears."""
    if config.kernels.gemm_tuning == "off":
        return
    from primus.tune.runtime import setup

    tuning = setup(config, info.device)
    for part in model_parts:
        tuning.apply(part)
    _active["tuning"] = tuning


@hookimpl
def primus_on_optimizer_step(step: int, info: Any) -> None:
    """``kernels.gemm_tuning: online``: search the GEMM shapes this step met that are not tuned yet."""
    tuning = _active.get("tuning")
    if tuning is not None:
        tuning.step_end(step)


@hookimpl
def primus_on_train_end(summary: dict[str, Any], info: Any) -> None:
    tuning = _active.pop("tuning", None)
    if tuning is not None:
        summary["gemm_tuning"] = tuning.close()
        if info.rank == 0:
            log.info("gemm tuning: %s", summary["gemm_tuning"])
