"""The ``tune`` entry point: tuned recipes, a default GEMM results file, and the ``tune`` / ``benchmark`` commands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from primus.core import hookimpl
from primus.tune.gemm import default_results_file

PRESETS_DIR = Path(__file__).parent / "presets"


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
