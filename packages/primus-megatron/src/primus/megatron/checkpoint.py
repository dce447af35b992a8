"""Checkpoints with megatron-core's ``dist_checkpointing``: each rank writes its shards, any layout
can load them (resharding TP / PP / VPP / DP).

Layout: ``<dir>/step_00000012/`` per checkpoint. A save is atomic: every rank writes into
``step_00000012.tmp``; after all ranks are done (a barrier), rank 0 writes the manifest
(``manifest.json``: step, config hash, model shape, versions) last, then renames the folder. So a
checkpoint is complete exactly when its folder is named ``step_<N>`` and holds a manifest of step N;
resume takes the newest complete one, and a partial folder (a rank killed mid-save leaves a ``.tmp``
without manifest) never shadows it. The next save removes such leftovers; ``keep_last`` counts
complete checkpoints only. Resume refuses a checkpoint of another model shape, naming both.

Contents: the model (all chunks), the optimizer (fp32 main params and Adam state, resharded across
DP with the distributed optimizer), the LR scheduler and the step (which is also the data position,
see :mod:`primus.megatron.data`).

A *seed checkpoint* holds only the model at step 0; loading it makes every layout start from the
same weights (megatron's TP/PP-dependent init otherwise differs between layouts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from primus.core.config.schema import PrimusConfig
from primus.megatron import compat as mc

log = logging.getLogger("primus.megatron.checkpoint")

_STEP = re.compile(r"^step_(\d{8})$")
_TMP = re.compile(r"^step_(\d{8})\.tmp$")
MANIFEST = "manifest.json"
# What makes two models' checkpoints interchangeable (every layout of the same shape can load it).
SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "kv_channels",
    "ffn_hidden_size",
    "vocab_size",
    "tie_word_embeddings",
    "qkv_bias",
    "qk_norm",
)


class CheckpointMismatch(ValueError):
    """A checkpoint that this run's model cannot load."""


def model_shape(cfg: PrimusConfig) -> dict[str, Any]:
    return {k: getattr(cfg.model, k) for k in SHAPE_KEYS}


def manifest(cfg: PrimusConfig, step: int, layout: dict[str, int]) -> dict[str, Any]:
    """What a checkpoint says about itself; written last, so its presence marks a complete save."""
    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    return {
        "step": step,
        "config_hash": hashlib.sha256(text.encode()).hexdigest(),
        "model_name": cfg.model.name,
        "model_shape": model_shape(cfg),
        "layout": layout,
        "versions": {d: version(d) for d in ("primus-megatron", "primus-core", "megatron-core", "torch")},
    }


def _model_sd(chunks: list[Any]) -> dict[str, Any]:
    return {f"chunk{i}": mc.model_sharded_state_dict(c) for i, c in enumerate(chunks)}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP.match(p.name)
        if m and p.is_dir():
            man = read_manifest(p)
            if man is not None and man.get("step") == int(m.group(1)):
                found.append((int(m.group(1)), p))
            else:
                log.warning("ignoring %s: no manifest of its step (an incomplete save)", p)
    return sorted(found)


def latest(root: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def _save(
    sd: dict[str, Any],
    final: Path,
    man: dict[str, Any],
    rank: int,
    before_commit: Callable[[], None] | None = None,
) -> None:
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    mc.checkpoint_writer_dies_with_rank()
    mc.dist_checkpointing.save(sd, str(tmp))
    if before_commit is not None:
        before_commit()
    _barrier()  # every rank's shards are on disk
    if rank == 0:
        (tmp / MANIFEST).write_text(json.dumps(man, indent=1))
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
    final = root / f"step_{step:08d}"
    _save(sd, final, man, rank, before_commit)
    if rank == 0:
        for _, old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for p in root.iterdir():  # partial saves of a run that died (a later complete one exists now)
            m = _TMP.match(p.name)
            if m and int(m.group(1)) <= step:
                shutil.rmtree(p, ignore_errors=True)
    log.info("saved checkpoint %s", final)
    return final


def check_compatible(path: Path, cfg: PrimusConfig) -> dict[str, Any]:
    """The manifest of ``path``; refuses a checkpoint of another model shape, naming both."""
    man = read_manifest(path)
    if man is None:
        raise CheckpointMismatch(f"{path} has no {MANIFEST}: not a complete primus-megatron checkpoint")
    ours = model_shape(cfg)
    theirs = man.get("model_shape", {})
    if theirs != ours:
        diff = ", ".join(f"{k} {theirs.get(k)} vs {ours[k]}" for k in SHAPE_KEYS if theirs.get(k) != ours[k])
        raise CheckpointMismatch(
            f"checkpoint {path} holds a model of another shape ({diff}): checkpoint "
            f"{man.get('model_name')} {theirs}, this run {cfg.model.name} {ours}"
        )
    mine = {d: version(d) for d in man.get("versions", {})}
    if mine != man.get("versions", mine):
        log.warning("checkpoint %s was written with %s; this run has %s", path, man["versions"], mine)
    return man


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
