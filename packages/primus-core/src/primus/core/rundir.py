"""Where a run writes: its output folder and its checkpoint folder."""

from __future__ import annotations

from pathlib import Path

from primus.core.config.schema import PrimusConfig


def output_dir(cfg: PrimusConfig) -> Path:
    return Path(cfg.logging.output_dir or f"outputs/{cfg.model.name}")


def checkpoint_root(cfg: PrimusConfig) -> Path:
    """``checkpoint.dir``, by default ``<output_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else output_dir(cfg) / "checkpoints"
