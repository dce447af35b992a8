"""The ``tune`` entry point: tuned recipes, and a default GEMM results file for offline tuning."""

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
def primus_configure(config: dict[str, Any]) -> dict[str, Any] | None:
    """``kernels.gemm_tuning: offline`` without a ``gemm_tuning_file``: use the per-model default file."""
    kernels = config.get("kernels") or {}
    if kernels.get("gemm_tuning") != "offline" or kernels.get("gemm_tuning_file"):
        return None
    return {"kernels.gemm_tuning_file": str(default_results_file(config))}
