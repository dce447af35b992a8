"""Checkpoints with megatron-core's ``dist_checkpointing``: each rank writes its shards, any layout
can load them (resharding TP / PP / VPP / DP).

Layout: ``<dir>/step_00000012/`` per checkpoint. A save goes to ``step_00000012.tmp`` and is
renamed by rank 0 after every rank has finished, so a directory without ``.tmp`` is complete and
resume takes the newest of those. Contents: the model (all chunks), the optimizer (fp32 main params
and Adam state, resharded across DP with the distributed optimizer), the LR scheduler and the step
(which is also the data position, see :mod:`primus.megatron.data`).

A *seed checkpoint* holds only the model at step 0; loading it makes every layout start from the
same weights (megatron's TP/PP-dependent init otherwise differs between layouts).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from primus.megatron import compat as mc

log = logging.getLogger("primus.megatron.checkpoint")

_STEP = re.compile(r"^step_(\d{8})$")


def _model_sd(chunks: list[Any]) -> dict[str, Any]:
    return {f"chunk{i}": mc.model_sharded_state_dict(c) for i, c in enumerate(chunks)}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return sorted(found)


def latest(root: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def _save(sd: dict[str, Any], final: Path, meta: dict[str, Any], rank: int) -> None:
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    mc.dist_checkpointing.save(sd, str(tmp))
    _barrier()
    if rank == 0:
        (tmp / "primus.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier()


def save(
    root: Path,
    step: int,
    chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    rank: int,
    keep_last: int,
    meta: dict[str, Any],
) -> Path:
    model_sd = _model_sd(chunks)
    sd = {
        "model": model_sd,
        "optimizer": mc.optimizer_sharded_state_dict(optimizer, model_sd, is_loading=False),
        "scheduler": scheduler.state_dict(),
        "step": step,
    }
    final = root / f"step_{step:08d}"
    _save(sd, final, {**meta, "step": step}, rank)
    if rank == 0:
        for _, old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    log.info("saved checkpoint %s", final)
    return final


def load(path: Path, chunks: list[Any], optimizer: Any, scheduler: Any) -> int:
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


def save_seed(path: Path, chunks: list[Any], rank: int, meta: dict[str, Any]) -> None:
    _save({"model": _model_sd(chunks)}, path, {**meta, "seed": True}, rank)
    log.info("saved seed checkpoint %s", path)


def load_seed(path: Path, chunks: list[Any]) -> None:
    state = mc.dist_checkpointing.load({"model": _model_sd(chunks)}, str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model"][f"chunk{i}"])
    log.info("loaded seed checkpoint %s", path)
