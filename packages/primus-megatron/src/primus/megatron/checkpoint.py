"""Checkpoints with megatron-core's ``dist_checkpointing``: each rank writes its shards, any layout
can load them (resharding TP / PP / VPP / DP).

Layout: ``<dir>/step_00000012/`` per checkpoint. A save is atomic: every rank writes into
``step_00000012.tmp``; after all ranks are done (a barrier), rank 0 writes the manifest
(``manifest.json``: step, config hash, model shape, versions) last, then renames the folder. So a
checkpoint is complete exactly when its folder is named ``step_<N>`` and holds a manifest of step N;
resume takes the newest complete one, and a partial folder (a rank killed mid-save leaves a ``.tmp``
without manifest) never shadows it. The next save removes such leftovers; ``keep_last`` counts
complete checkpoints only. Resume refuses a checkpoint of another model shape, naming both. The
bookkeeping (manifest, completeness, keep-last, shape check) is core's :mod:`primus.core.checkpoints`.

Contents: the model (all chunks), the optimizer (fp32 main params and Adam state, resharded across
DP with the distributed optimizer), the LR scheduler and the step (which is also the data position,
see :mod:`primus.megatron.data`).

A *seed checkpoint* holds only the model at step 0; loading it makes every layout start from the
same weights (megatron's TP/PP-dependent init otherwise differs between layouts).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from primus.core import checkpoints as core
from primus.core.checkpoints import read_manifest
from primus.core.config.schema import PrimusConfig
from primus.megatron import compat as mc

log = logging.getLogger("primus.megatron.checkpoint")

__all__ = ["read_manifest"]

NAMING = core.Naming("step_{step:08d}", re.compile(r"^step_(\d{8})$"))
DISTRIBUTIONS = ("primus-megatron", "primus-core", "megatron-core", "torch")


def manifest(cfg: PrimusConfig, step: int, layout: dict[str, int]) -> dict[str, Any]:
    """What a checkpoint says about itself; written last, so its presence marks a complete save."""
    return core.manifest(cfg, step, layout, DISTRIBUTIONS)


def _model_sd(chunks: list[Any]) -> dict[str, Any]:
    return {f"chunk{i}": mc.model_sharded_state_dict(c) for i, c in enumerate(chunks)}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``, oldest first."""
    return core.complete_checkpoints(root, NAMING)


def latest(root: Path) -> tuple[int, Path] | None:
    return core.latest(root, NAMING)


def _save(
    sd: dict[str, Any],
    final: Path,
    man: dict[str, Any],
    rank: int,
    before_commit: Callable[[], None] | None = None,
) -> None:
    def write(tmp: Path) -> None:
        mc.checkpoint_writer_dies_with_rank()
        mc.dist_checkpointing.save(sd, str(tmp))
        if before_commit is not None:
            before_commit()

    core.atomic_save(final, man, rank, write, _barrier)


def save(
    root: Path,
    step: int,
    chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    rank: int,
    keep_last: int,
    man: dict[str, Any],
    before_commit: Callable[[], None] | None = None,
) -> Path:
    """Write the step-``step`` checkpoint atomically; ``before_commit`` runs on each rank after its
    shards are written and before the checkpoint is committed (the fault injector's kill point)."""
    model_sd = _model_sd(chunks)
    sd = {
        "model": model_sd,
        "optimizer": mc.optimizer_sharded_state_dict(optimizer, model_sd, is_loading=False),
        "scheduler": scheduler.state_dict(),
        "step": step,
    }
    final = NAMING.folder(root, step)
    _save(sd, final, man, rank, before_commit)
    if rank == 0:
        core.purge(root, NAMING, keep_last)
    log.info("saved checkpoint %s", final)
    return final


def check_compatible(path: Path, cfg: PrimusConfig) -> dict[str, Any]:
    """The manifest of ``path``; refuses a checkpoint of another model shape, naming both."""
    return core.check_compatible(path, cfg, "primus-megatron")


def load(path: Path, chunks: list[Any], optimizer: Any, scheduler: Any, cfg: PrimusConfig) -> int:
    check_compatible(path, cfg)
    mc.prepare_optimizer_for_load(optimizer)
    model_sd = _model_sd(chunks)
    sd = {
        "model": model_sd,
        "optimizer": mc.optimizer_sharded_state_dict(optimizer, model_sd, is_loading=True),
        "scheduler": scheduler.state_dict(),
        "step": 0,
    }
    state = mc.dist_checkpointing.load(sd, str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model"][f"chunk{i}"])
    with torch.no_grad():  # the distributed optimizer copies into (views of) leaf parameters
        optimizer.load_state_dict(state["optimizer"])
    mc.restore_adam_step(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])


def save_seed(path: Path, chunks: list[Any], rank: int, man: dict[str, Any]) -> None:
    _save({"model": _model_sd(chunks)}, path, {**man, "seed": True}, rank)
    log.info("saved seed checkpoint %s", path)


def load_seed(path: Path, chunks: list[Any], cfg: PrimusConfig) -> None:
    check_compatible(path, cfg)
    state = mc.dist_checkpointing.load({"model": _model_sd(chunks)}, str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model"][f"chunk{i}"])
    log.info("loaded seed checkpoint %s", path)
