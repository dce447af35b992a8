"""TorchTitan's state in a checkpoint folder, through torchtitan's own checkpointer (DCP: each rank writes its
shards, any layout can load them, resharding FSDP / TP / PP / DP).

Core's loop owns the policy (:mod:`primus.core.run.loop`: folder names ``step_00000012``, when to save, atomic
commit with the manifest, keep-last, resume, the shape check); this module writes and reads the engine's part
with torchtitan's ``CheckpointManager.dcp_save`` / ``dcp_load`` over the states torchtitan itself checkpoints:
the model, the optimizers, the LR schedulers, the data loader (its position: a resumed run continues with the
next unseen samples, also at another data-parallel size) and the train state.

A *seed checkpoint* (``backend.extra.checkpoint.create_seed_checkpoint``) holds only the model at step 0 (the
weights the run would start from: ``train.init`` and ``train.init_from`` applied), taken by
``checkpoint.initial_load_path`` (as are Hugging Face folders, through the state-dict adapter) as the initial
weights: :func:`load_initial`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from primus.core.config.schema import PrimusConfig
from primus.core.run import checkpoints as core
from primus.torchtitan import compat

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager  # noqa: E402

log = logging.getLogger("primus.torchtitan.checkpoint")

NAMING = core.NAMING
DISTRIBUTIONS = ("primus-torchtitan", "primus-core", "torchtitan", "torch")
BACKEND = "primus-torchtitan"


def manifest(cfg: PrimusConfig, step: int, layout: dict[str, int]) -> dict[str, Any]:
    man = core.manifest(cfg, step, layout, DISTRIBUTIONS)
    if step == 0:
        man["seed"] = True  # the initial weights only
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


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def write(checkpointer: CheckpointManager, folder: Path) -> None:
    """This rank's shards of every state torchtitan checkpoints into ``folder`` (core commits it)."""
    states = checkpointer._flattened_model_states_sd()
    checkpointer.dcp_save(states, str(folder), AsyncMode.DISABLED, enable_garbage_collection=True)


def read(checkpointer: CheckpointManager, folder: Path) -> None:
    """Load what :func:`write` wrote, resharded to this run's layout (``checkpoint.exclude_from_loading`` kept)."""
    states = checkpointer._states_to_load(model_only=False)
    checkpointer.dcp_load(states, str(folder), from_hf=False, from_quantized=False)


def load_model(checkpointer: CheckpointManager, folder: Path, cfg: PrimusConfig) -> None:
    """The model weights of a torchtitan checkpoint of any layout (a seed, an import or a training checkpoint)."""
    check_compatible(folder, cfg)
    checkpointer.dcp_load(checkpointer.states[MODEL].state_dict(), str(folder), from_hf=False, from_quantized=False)
    log.info("initialised the model from %s", folder)


def load_initial(checkpointer: CheckpointManager, cfg: PrimusConfig) -> bool:
    """The initial weights torchtitan's config names (``checkpoint.initial_load_path``: a seed checkpoint or,
    with ``initial_load_in_hf``, a Hugging Face folder), never a checkpoint of core's folder; a Primus seed is
    checked against the model first. Returns whether anything was loaded."""
    if not checkpointer.enable:  # (a disabled checkpointer is built without its initial_load_* attributes)
        return False
    path = checkpointer.initial_load_path
    if not (path or checkpointer.initial_load_in_hf):
        return False
    if path and not checkpointer.initial_load_in_hf and core.read_manifest(Path(path)) is not None:
        check_compatible(Path(path), cfg)
    folder = getattr(checkpointer, "folder", "")
    checkpointer.folder = str(Path(folder or ".") / "no-such-folder")  # torchtitan's initial-load branch
    try:
        return checkpointer.load()
    finally:
        checkpointer.folder = folder


def save_seed(checkpointer: CheckpointManager, root: Path, cfg: PrimusConfig, layout_: dict[str, int]) -> Path:
    """The model alone as the step-0 checkpoint under ``root``: every layout can start from these weights."""
    final = NAMING.folder(root, 0)
    rank = dist.get_rank() if dist.is_initialized() else 0

    def write_model(tmp: Path) -> None:
        checkpointer.dcp_save(checkpointer.states[MODEL].state_dict(), str(tmp), AsyncMode.DISABLED)

    core.atomic_save(final, manifest(cfg, 0, layout_), rank, write_model, _barrier)
    log.info("saved seed checkpoint %s", final)
    return final
