"""TorchTitan's state in a checkpoint folder, through torchtitan's own checkpointer (DCP: each rank writes its
shards, any layout can load them, resharding FSDP / TP / PP / DP).

Core's loop owns the policy (:mod:`primus.core.run.loop`: folder names ``step_00000012``, when to save, atomic
commit with the manifest, keep-last, resume, the shape check); this module writes and reads the engine's part
with torchtitan's ``CheckpointManager.dcp_save`` / ``dcp_load`` over the states torchtitan itself checkpoints:
the model, the optimizers, the LR schedulers, the data loader (its position: a resumed run continues with the
next unseen samples, also at another data-parallel size) and the train state.

The weights a run starts from are core's keys on every engine: ``train.save_initial`` writes them (the model alone,
:func:`write_model`), ``train.init_from`` loads them (:func:`load_model`, any layout) or a Hugging Face folder.

A checkpoint plain TorchTitan wrote (``primus checkpoint import --from``, recognised by :mod:`primus.torchtitan.native`)
is read by :func:`load_native`: the same checkpointer's format, so its model keys and its optimizer and LR-scheduler
states are those Primus's own checkpoints hold; what differs is Primus's (the optimizer's param groups, the data
position), kept.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from primus.core.config.schema import PrimusConfig
from primus.core.contracts.errors import UserError
from primus.core.contracts.native import NativeCheckpoint
from primus.core.run import checkpoints as core
from primus.torchtitan import compat, native
from primus.torchtitan.lora import is_adapter

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.components.checkpoint import (  # noqa: E402
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    AsyncMode,
    CheckpointManager,
)

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


def write(checkpointer: CheckpointManager, folder: Path, leave_out: Collection[str] = ()) -> None:
    """This rank's shards of every state torchtitan checkpoints into ``folder`` (core commits it), but the model keys
    ``leave_out`` (a LoRA run's frozen base: :func:`primus.torchtitan.lora.base_keys`)."""
    states = {k: v for k, v in checkpointer._flattened_model_states_sd().items() if k not in leave_out}
    checkpointer.dcp_save(states, str(folder), AsyncMode.DISABLED, enable_garbage_collection=True)


def read(checkpointer: CheckpointManager, folder: Path, leave_out: Collection[str] = ()) -> None:
    """Load what :func:`write` wrote, resharded to this run's layout (``checkpoint.exclude_from_loading`` kept)."""
    states = {k: v for k, v in checkpointer._states_to_load(model_only=False).items() if k not in leave_out}
    checkpointer.dcp_load(states, str(folder), from_hf=False, from_quantized=False)


def load_model(checkpointer: CheckpointManager, folder: Path, cfg: PrimusConfig) -> None:
    """The model weights of a torchtitan checkpoint of any layout (a seed, an import or a training checkpoint)."""
    check_compatible(folder, cfg)
    # a LoRA run's base: the source holds no adapters (they start from train.lora's values)
    states = {k: v for k, v in checkpointer.states[MODEL].state_dict().items() if not is_adapter(k)}
    checkpointer.dcp_load(states, str(folder), from_hf=False, from_quantized=False)
    log.info("initialised the model from %s", folder)


def write_model(checkpointer: CheckpointManager, folder: Path) -> None:
    """This rank's shards of the model alone into ``folder`` (core commits it: ``train.save_initial``); any layout
    loads it (:func:`load_model`). A LoRA run's holds its base and its initial adapters."""
    checkpointer.dcp_save(checkpointer.states[MODEL].state_dict(), str(folder), AsyncMode.DISABLED)


# ------------------------------------------------------------------------------------------------ TorchTitan's own

#: model state with no counterpart to check in every source: the MoE routing bias of loss-free balancing (a source
#: without it routed as with zeros, the value the model starts from)
_OPTIONAL = ("moe.expert_bias",)
_TIED = ("tok_embeddings.weight", "output.weight")


def load_native(trainer: Any, found: NativeCheckpoint, cfg: PrimusConfig, weights_only: bool) -> list[str]:
    """A checkpoint plain TorchTitan wrote (:mod:`primus.torchtitan.native`) into ``trainer``'s objects, resharded
    to its layout (DCP): the model, checked first against the config's (:func:`check_model`: one line naming the
    tensor and both shapes), and unless ``weights_only`` the optimizer state, the LR schedulers' and the train state
    where the source holds them. Returns what was loaded.

    The optimizer's param groups stay Primus's (its learning rate is core's schedule, its norms and biases take no
    weight decay: :func:`primus.torchtitan.trainer.exempt_from_weight_decay`): only the per-parameter state (Adam's
    step, exp_avg, exp_avg_sq) is taken. The source's data loader position is its own data's, not Primus's, and is
    left out (core's manifest records that the run's data order is its own from this step)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    checkpointer = trainer.checkpointer
    folder = str(found.folder)
    metadata = FileSystemReader(folder).read_metadata()
    keys = metadata.state_dict_metadata
    model_sd = checkpointer.states[MODEL].state_dict()
    theirs = native.model_shapes(metadata)
    check_model({k: tuple(v.shape) for k, v in model_sd.items()}, theirs, cfg, found)
    check_tying(metadata, found.folder, cfg)
    checkpointer.dcp_load(
        {k: v for k, v in model_sd.items() if k in theirs}, folder, from_hf=False, from_quantized=False
    )
    loaded = ["model"]
    if weights_only:
        return loaded
    states = set(found.details.get("states", ()))
    if "optimizer" in states:
        optimizers = checkpointer.states[OPTIMIZER]
        sd = optimizers.state_dict()  # flattened per parameter, as torchtitan's OptimizersContainer saves it
        wanted = {k: v for k, v in sd.items() if k.startswith("state.")}
        if lacking := [f"optimizer.{k}" for k in wanted if f"optimizer.{k}" not in keys]:
            raise UserError(
                f"{found.folder}: its optimizer state has no {lacking[0]} ({len(lacking)} entries missing): not the "
                f"state of the run's {cfg.train.optimizer.name} (Adam's step, exp_avg, exp_avg_sq per parameter)"
            )
        dcp.load({OPTIMIZER: wanted}, checkpoint_id=folder)
        optimizers.load_state_dict({**sd, **wanted})  # the param groups (hyperparameters) as they were
        loaded.append("optimizer state")
    if "lr_scheduler" in states:
        # torchtitan's schedulers never step in Primus (the learning rate is core's, set each step): their state is
        # carried along for the record
        dcp.load({LR_SCHEDULER: checkpointer.states[LR_SCHEDULER]}, checkpoint_id=folder)
        loaded.append("LR scheduler")
    if "train_state" in states:
        dcp.load({TRAIN_STATE: trainer}, checkpoint_id=folder)  # step, ntokens_seen
        loaded.append("train state")
    # "dataloader" is left out: the source's position in its own data set, which is not this run's (the engine puts
    # Primus's data loader at the source's step of the run's own data order)
    log.info("loaded %s from %s", ", ".join(loaded), found.folder)
    return loaded


def check_model(
    ours: dict[str, tuple[int, ...]], theirs: dict[str, tuple[int, ...]], cfg: PrimusConfig, found: NativeCheckpoint
) -> None:
    """Refuse (one line) a source whose model is not the config's: a tensor of another shape, one the model has and
    the checkpoint lacks, or one the checkpoint holds and the model lacks (dropping it would change the model)."""
    m = cfg.model
    mine = f"model {m.name!r} of the config ({m.family}, {m.num_layers} layers, hidden {m.hidden_size})"
    source = f"the checkpoint ({native.describe(theirs)})"
    advice = "give the config of the model the source trained (its TorchTitan flavor's shapes)"
    for key, shape in ours.items():
        if key in theirs and theirs[key] != shape:
            raise UserError(
                f"{found.folder}: {key} is {list(theirs[key])} in {source}, {list(shape)} in {mine}; {advice}"
            )
    missing = [k for k in ours if k not in theirs and not k.endswith(_OPTIONAL)]
    if missing:
        if all(k.endswith((".wq.bias", ".wk.bias", ".wv.bias")) for k in missing):
            advice = "TorchTitan's models have no q/k/v bias: give a config with model.qkv_bias: false"
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{found.folder}: {source} has no {missing[0]}{more}, which {mine} has; {advice}")
    extra = [k for k in theirs if k not in ours]
    if extra:
        if all(k.endswith(_OPTIONAL) for k in extra):
            advice = "the source routes with a learned expert bias: give a config with model.moe.balancing: loss_free"
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise UserError(f"{found.folder}: {source} holds {extra[0]}{more}, which {mine} lacks; {advice}")


def check_tying(metadata: Any, folder: Path, cfg: PrimusConfig) -> None:
    """Refuse a source whose output head is tied to its embedding where the config's is not, or the other way: both
    tensors are in the checkpoint either way (torchtitan saves a tied weight under both names). With an optimizer
    state, a tied weight has one entry; without, the two tensors are compared."""
    import torch
    import torch.distributed.checkpoint as dcp

    keys = metadata.state_dict_metadata
    if not all(k in keys for k in _TIED):
        return  # check_model has refused whatever lacks one
    if any(k.startswith(f"optimizer.state.{_TIED[0]}.") for k in keys):
        tied = not any(k.startswith(f"optimizer.state.{_TIED[1]}.") for k in keys)
    else:
        pair = {k: torch.empty(keys[k].size, dtype=keys[k].properties.dtype) for k in _TIED}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": whole tensors, as intended
            dcp.load(pair, checkpoint_id=str(folder), no_dist=True)
        tied = torch.equal(*pair.values())
    if tied != cfg.model.tie_word_embeddings:
        says = "ties output.weight to" if tied else "does not tie output.weight to"
        raise UserError(
            f"{folder}: the source {says} tok_embeddings.weight, model {cfg.model.name!r} of the config "
            f"{'does' if cfg.model.tie_word_embeddings else 'does not'}; give a config with "
            f"model.tie_word_embeddings: {str(tied).lower()}"
        )
