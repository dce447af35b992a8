"""Atomic, resumable checkpoints on torchtitan's own checkpointer (DCP: each rank writes its shards, any
layout can load them, resharding FSDP / TP / PP / DP).

Layout: ``<dir>/step-12/`` per checkpoint (torchtitan's names). :class:`AtomicCheckpointManager` is
torchtitan's ``CheckpointManager`` with five methods replaced, so what and when it saves stays
torchtitan's, while the bookkeeping is Primus's (:mod:`primus.core.checkpoints`, as in the megatron
backend). Its methods replaced:

- ``dcp_save``: every rank writes into ``step-12.tmp``; after a barrier rank 0 writes ``manifest.json``
  (step, config hash, model shape, layout, versions of torch / torchtitan / primus, time) last and
  renames the folder to ``step-12``. A rank killed mid-save leaves a ``.tmp`` without manifest;
- ``_find_load_step`` (resume): the newest *complete* checkpoint (final name + manifest of its step);
  partial folders never shadow it, and with none (``load``) the run starts from its initial weights;
- ``dcp_load``: refuses a checkpoint of another model shape (from its manifest, before DCP reads any
  tensor), naming both shapes;
- ``_purge_stale_checkpoints`` (``checkpoint.keep_last``): counts complete checkpoints only; partial
  saves stay for inspection until a complete save of a later step removes them.

Async checkpointing is refused (``backend.extra.checkpoint.async_mode``): its save completes after
``dcp_save`` returns, so there would be nothing to commit at that point.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from primus.core import checkpoints as core
from primus.core.config.schema import PrimusConfig
from primus.torchtitan import compat
from primus.torchtitan.faults import FaultInjection

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager  # noqa: E402

log = logging.getLogger("primus.torchtitan.checkpoint")

NAMING = core.Naming("step-{step}", re.compile(r"^step-(\d+)$"))
DISTRIBUTIONS = ("primus-torchtitan", "primus-core", "torchtitan", "torch")
BACKEND = "primus-torchtitan"


def manifest(cfg: PrimusConfig, step: int, layout: dict[str, int]) -> dict[str, Any]:
    man = core.manifest(cfg, step, layout, DISTRIBUTIONS)
    if step == 0:
        man["seed"] = True  # the initial weights only (torchtitan saves step 0 model-only)
    return man


def complete_steps(root: Path) -> list[int]:
    return [step for step, _ in core.complete_checkpoints(root, NAMING)]


def check_compatible(path: Path, cfg: PrimusConfig) -> dict[str, Any]:
    return core.check_compatible(path, cfg, BACKEND)


def layout(cfg: PrimusConfig, world_size: int) -> dict[str, int]:
    p = cfg.parallel
    return {
        "world": world_size,
        "dp": p.dp_replicate * int(p.dp_shard),
        "dp_replicate": p.dp_replicate,
        "dp_shard": int(p.dp_shard),
        "tp": p.tp,
        "pp": p.pp,
        "cp": p.cp,
    }


def save_one_process(target: Path, cfg: PrimusConfig, write: Callable[[Path], None]) -> None:
    """A checkpoint written by one process outside training (``primus checkpoint import``), committed like
    every other (``write(tmp)``, manifest, rename), so ``--resume`` and the shape check take it."""
    step = NAMING.step_of(target.name)
    if step is None:
        raise ValueError(f"{target}: a checkpoint folder is named step-N")
    core.atomic_save(target, manifest(cfg, step, layout(cfg, 1)), 0, write, lambda: None)


@dataclass(frozen=True)
class CheckpointContext:
    """What the checkpointer needs from Primus: the config (manifest, shape check), the layout and the
    test-only fault injector."""

    cfg: PrimusConfig
    layout: dict[str, int]
    faults: FaultInjection = field(default_factory=FaultInjection)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class AtomicCheckpointManager(CheckpointManager):
    """torchtitan 0.2.2's CheckpointManager with atomic saves, manifest-based resume and shape checks."""

    def __init__(self, *args: Any, primus: CheckpointContext, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.primus = primus
        mode = getattr(self, "async_mode", AsyncMode.DISABLED)  # unset when checkpointing is off
        if mode != AsyncMode.DISABLED:
            raise ValueError(
                f"backend.extra.checkpoint.async_mode={mode.value}: Primus's atomic checkpoints need "
                "synchronous saves (allowed: disabled)"
            )

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> None:
        final = Path(checkpoint_id)
        step = NAMING.step_of(final.name)
        if step is None or async_mode != AsyncMode.DISABLED:
            raise ValueError(f"unexpected torchtitan save of {checkpoint_id} (async_mode {async_mode})")
        rank = _rank()

        def write(tmp: Path) -> None:
            CheckpointManager.dcp_save(self, state_dict, str(tmp), async_mode, enable_garbage_collection, to_hf)
            self.primus.faults.during_save(step, rank)

        man = manifest(self.primus.cfg, step, self.primus.layout)
        core.atomic_save(final, man, rank, write, _barrier)
        log.info("committed checkpoint %s", final)

    def save(self, curr_step: int, last_step: bool = False) -> None:
        super().save(curr_step, last_step)
        # torchtitan 0.2.2 purges old checkpoints (keep_latest_k) after interval saves but returns before purging
        # on the last step's save, so a run would end with one more than checkpoint.keep_last
        if last_step and self.enable and self.keep_latest_k > 0:
            self._purge_stale_checkpoints()

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        path = Path(checkpoint_id)
        if from_hf:
            pass  # Hugging Face safetensors (train.init_from_hf): checked against the model by primus.torchtitan.hf
        elif core.read_manifest(path) is not None or path.parent == Path(self.folder):
            check_compatible(path, self.primus.cfg)
        else:  # an initial_load_path written by torchtitan itself
            log.info("%s has no %s: loading it without the model-shape check", path, core.MANIFEST)
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

    def load(self, step: int = -1) -> bool:
        """torchtitan loads ``initial_load_path`` (seed, HF weights) only while the checkpoint folder does
        not exist. A folder holding only partial saves (a run killed during its first save) has nothing
        to resume either: start from the initial weights, as a fresh run would."""
        if step == -1 and self.enable and os.path.isdir(self.folder) and self._find_load_step() == -1:
            folder, self.folder = self.folder, os.path.join(self.folder, "no-complete-checkpoint")
            try:
                return super().load(step)
            finally:
                self.folder = folder
        return super().load(step)

    def _find_load_step(self, folder: str = "") -> int:
        found = core.latest(Path(folder or self.folder), NAMING)
        return found[0] if found else -1

    def _purge_stale_checkpoints(self) -> None:
        if self.keep_latest_k > 0 and _rank() == 0:
            core.purge(Path(self.folder), NAMING, self.keep_latest_k)
