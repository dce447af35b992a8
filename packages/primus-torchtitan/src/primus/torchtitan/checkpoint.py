"""TorchTitan's state in a checkpoint folder, through torchtitan's own checkpointer (DCP: each rank writes its
shards, any layout can load them, resharding FSDP / TP / PP / DP).

Core's loop owns the policy (:mod:`primus.core.run.loop`: folder names ``step_00000012``, when to save, atomic
commit with the manifest, keep-last, resume, the shape check); this module writes and reads the engine's part
with torchtitan's ``CheckpointManager.dcp_save`` / ``dcp_load`` over the states torchtitan itself checkpoints:
the model, the optimizers, the LR schedulers, the data loader (its position: a resumed run continues with the
next unseen samples, also at another data-parallel size) and the train state.

The weights a run starts from are core's keys on every engine: ``train.save_initial`` writes them (the model alone,
:func:`write_model`), ``train.init_from`` loads them (:func:`load_model`, any layout) or a Hugging Face folder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    return core.manifest(cfg, step, layout, DISTRIBUTIONS)


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


def save_one_process(target: Path, cfg: PrimusConfig, write: Callable[[Path], None], source: str) -> None:
    """The weights alone, written by one process outside training (``primus checkpoint import`` of ``source``),
    committed like every checkpoint (``write(tmp)``, the manifest with core's ``weights_only`` record, rename), so
    ``train.init_from`` and the shape check take it."""
    step = NAMING.step_of(target.name)
    if step is None:
        raise ValueError(f"{target}: a checkpoint folder is named step-N")
    man = {**manifest(cfg, step, layout(cfg, 1)), "weights_only": core.weights_only(cfg, source)}
    core.atomic_save(target, man, 0, write, lambda: None)


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


def write_model(checkpointer: CheckpointManager, folder: Path) -> None:
    """This rank's shards of the model alone into ``folder`` (core commits it: ``train.save_initial``); any layout
    loads it (:func:`load_model`)."""
    checkpointer.dcp_save(checkpointer.states[MODEL].state_dict(), str(folder), AsyncMode.DISABLED)
