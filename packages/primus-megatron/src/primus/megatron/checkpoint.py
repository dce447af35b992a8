"""Megatron's state in a checkpoint folder, with megatron-core's ``dist_checkpointing``: each rank writes its
shards, any layout can load them (resharding TP / PP / VPP / DP).

Core's loop owns the policy (:mod:`primus.core.run.loop`: folder names ``step_00000012``, when to save, atomic
commit with the manifest, keep-last, resume, the shape check); this module writes and reads the engine's part:
the model (all chunks) and the optimizer (fp32 main params and Adam state, resharded across DP with the
distributed optimizer). The step, which is also the data position (:mod:`primus.megatron.data`), and the
applied-update count that drives the learning rate ride in core's manifest.

A *seed checkpoint* holds only the model at step 0; loading it makes every layout start from the
same weights (megatron's TP/PP-dependent init otherwise differs between layouts).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from primus.core.config.schema import PrimusConfig
from primus.core.run import checkpoints as core
from primus.core.run.checkpoints import read_manifest
from primus.megatron import compat

log = logging.getLogger("primus.megatron.checkpoint")

__all__ = ["read_manifest"]

NAMING = core.NAMING
DISTRIBUTIONS = ("primus-megatron", "primus-core", "megatron-core", "torch")


def manifest(cfg: PrimusConfig, step: int, layout: dict[str, int]) -> dict[str, Any]:
    """What a checkpoint says about itself; written last, so its presence marks a complete save."""
    return core.manifest(cfg, step, layout, DISTRIBUTIONS)


def chunk_sharded_state_dict(chunk: Any) -> dict:
    """megatron's sharded state dict of one model chunk, given the data-parallel group as its metadata: on the
    multi-token-prediction stage of a pipeline megatron-core 0.16's GPTModel reads ``metadata['dp_cp_group']`` for
    its copy of the embedding and fills it in only for the modules below (None raised a TypeError there)."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    return chunk.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))


def model_sharded_state_dict(chunk: Any, whole: bool = False) -> dict:
    """A chunk's model state in a checkpoint; with LoRA adapters its adapters alone unless ``whole``
    (:func:`primus.megatron.lora.only_adapters`)."""
    from primus.megatron.lora import only_adapters

    sd = chunk_sharded_state_dict(chunk)
    if _fsdp2(chunk):
        _fsdp2_swiglu(sd)
    return sd if whole else only_adapters(sd) or sd


def _fsdp2(chunk: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in chunk.parameters())


def _fsdp2_swiglu(sd: dict) -> None:
    """FSDP2's rows of the SwiGLU fc1 weight as one regular shard of megatron's checkpoint tensor.

    megatron saves fc1 (the TP-local ``[gate_t; up_t]``) as its two halves, at the places of gate and up in the global
    ``[gate_0 .. gate_tp-1; up_0 .. up_tp-1]`` (``mlp.apply_swiglu_sharded_factory``). Under FSDP2 a rank holds rows
    ``d`` of ``dp`` of the TP-local tensor, not both halves, and the factory would save its two quarters in the wrong
    places (a checkpoint only the same layout reads back). With dp even, rank ``d``'s rows lie in one half ``h`` =
    d // (dp/2), sub-piece s = d % (dp/2): piece h·tp·dp/2 + t·dp/2 + s of tp·dp in the global tensor
    (validate.py refuses odd dp_shard with parallel.fsdp on this backend)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    tp, t = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    half = dp // 2
    for key, value in sd.items():
        if isinstance(value, dict):
            _fsdp2_swiglu(value)
        elif isinstance(value, ShardedTensorFactory) and value.key.endswith(("linear_fc1.weight", "linear_fc1.bias")):
            built = value.build()[0]
            n = built.prepend_axis_num
            prepend = [(i, built.global_offset[i], built.global_shape[i]) for i in range(n)]
            piece = (d // half) * tp * half + t * half + d % half
            sd[key] = ShardedTensor.from_rank_offsets(
                value.key, value.data, *prepend, (n, piece, tp * dp), replica_id=value.replica_id, prepend_axis_num=n
            )


def optimizer_sharded_state_dict(optimizer: Any, model_sd: dict, is_loading: bool) -> dict:
    # dp_reshardable: the distributed optimizer's state can be loaded at another DP size.
    return optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
    )


def _model_sd(chunks: list[Any], whole: bool = False) -> dict[str, Any]:
    return {f"chunk{i}": model_sharded_state_dict(c, whole) for i, c in enumerate(chunks)}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``, oldest first."""
    return core.complete_checkpoints(root, NAMING)


def latest(root: Path) -> tuple[int, Path] | None:
    return core.latest(root, NAMING)


def write(folder: Path, chunks: list[Any], optimizer: Any, experts_layout: str | None = None) -> None:
    """This rank's shards of the model (all chunks) and the optimizer into ``folder`` (core commits it), with how a
    mixture-of-experts model holds its experts' weights (``experts_layout``, in the checkpoint's common state)."""
    from megatron.core import dist_checkpointing

    model_sd = _model_sd(chunks)
    sd = {"model": model_sd, "optimizer": optimizer_sharded_state_dict(optimizer, model_sd, is_loading=False)}
    if experts_layout is not None:
        sd[EXPERTS_LAYOUT] = experts_layout
    compat.checkpoint_writer_dies_with_rank()
    dist_checkpointing.save(sd, str(folder))


def optimizer_sharded(folder: Path) -> bool | None:
    """Whether ``folder`` holds the distributed optimizer's state (sharded over data-parallel ranks) rather than the
    regular optimizer's (from the checkpoint's own index); None where it holds no optimizer state."""
    keys = _optimizer_keys(folder)
    return any(k.startswith("optimizer.distributed.") or ".optimizer.distributed." in k for k in keys) if keys else None


def _optimizer_keys(folder: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    # "optimizer.…" for one optimizer, "chained_<i>.optimizer.…" for megatron's chain of them
    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return [k for k in metadata if k.startswith(("optimizer.", "chained_"))]


def experts_mismatch(folder: Path, chained: bool, tp: int, ep: int) -> str | None:
    """Why a mixture-of-experts run cannot load ``folder``'s optimizer state: megatron-core 0.16 keeps the routed
    experts' parameters in an optimizer of their own where their data-parallel group is not the dense one (ep > 1 or
    tp > 1: primus.megatron.experts.experts_apart; a chain of two), one optimizer otherwise, and loads neither format
    as the other."""
    keys = _optimizer_keys(folder)
    if not keys or any(k.startswith("chained_") for k in keys) == chained:
        return None
    apart, together = "parallel.ep > 1 or parallel.tp > 1", "parallel.ep = 1 and parallel.tp = 1"
    return (
        f"checkpoint {folder} was written by a mixture-of-experts run with {together if chained else apart}, this run "
        f"has parallel.ep = {ep}, parallel.tp = {tp}: megatron-core 0.16 keeps the experts' optimizer state apart only "
        f"with {apart} and does not convert between the two; resume with {apart if not chained else together}"
    )


EXPERTS_LAYOUT = "experts_layout"


def experts_layout_mismatch(folder: Path, layout: str | None) -> str | None:
    """Why this run's experts (``layout``: stacked or per expert, primus.megatron.experts) cannot take ``folder``'s
    optimizer state: the two hold it as one tensor per weight kind or one per expert. Their weights load either way
    (``train.init_from``). Checkpoints from before the record hold per-expert weights (SequentialMLP's)."""
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    from primus.megatron.experts import PER_EXPERT, STACKED

    if layout is None:
        return None
    saved = load_common_state_dict(str(folder)).get(EXPERTS_LAYOUT, PER_EXPERT)
    if saved == layout or _optimizer_keys(folder) == []:  # the index only when the layouts differ
        return None
    kernels = {STACKED: "a grouped_gemm provider other than torch (e.g. kernels.grouped_gemm=auto)",
               PER_EXPERT: "kernels.grouped_gemm=torch (megatron's SequentialMLP)"}  # fmt: skip
    return (
        f"checkpoint {folder} holds the routed experts' optimizer state {saved.replace('_', ' ')}, this run holds "
        f"the experts' weights {layout.replace('_', ' ')}: resume with {kernels[saved]}, or start a new run from "
        f"its weights with train.init_from={folder}"
    )


def optimizer_mismatch(folder: Path, sharded: bool, dp: int) -> str | None:
    """Why this run's optimizer (``sharded`` over ``dp`` data-parallel ranks or not) cannot load ``folder``'s
    optimizer state, with the settings that can; None when it can. megatron-core 0.16 loads the distributed
    optimizer's state at any data-parallel size, and the regular optimizer's at any, but not one as the other. The
    regular one's Adam state is per model tensor, which the engine reads into a distributed optimizer itself before
    asking this (:func:`primus.megatron.native_load.read_regular_into_distributed`); the distributed one's follows
    its gradient buckets."""
    saved = optimizer_sharded(folder)
    if saved is None or saved == sharded:
        return None
    if saved:
        return (
            f"checkpoint {folder} holds the distributed optimizer's state (sharded over data-parallel ranks) and this "
            f"run uses megatron's regular optimizer (data-parallel size {dp}), which cannot load it: add "
            "parallel.distributed_optimizer=true (megatron-core reshards that state to any data-parallel size)"
        )
    return (
        f"checkpoint {folder} holds megatron's regular optimizer state and this run shards the optimizer over "
        f"{dp} data-parallel ranks (the distributed optimizer, the default for parallel.dp_shard > 1), which cannot "
        f"load it (only Adam's state converts): resume with parallel.dp_replicate={dp} parallel.dp_shard=1 (the "
        "regular optimizer, replicated), or from a checkpoint written with parallel.distributed_optimizer=true"
    )


def read(folder: Path, chunks: list[Any], optimizer: Any) -> None:
    """Load what :func:`write` wrote, resharded to this run's layout."""
    from megatron.core import dist_checkpointing

    compat.prepare_optimizer_for_load(optimizer)
    model_sd = _model_sd(chunks)
    sd = {"model": model_sd, "optimizer": optimizer_sharded_state_dict(optimizer, model_sd, is_loading=True)}
    state = dist_checkpointing.load(sd, str(folder))
    for i, chunk in enumerate(chunks):
        if not _fsdp2(chunk):  # FSDP2: dist_checkpointing loaded each rank's shards into its parameters in place
            load_model_state(chunk, state["model"][f"chunk{i}"])
    with torch.no_grad():  # the distributed optimizer copies into (views of) leaf parameters
        optimizer.load_state_dict(state["optimizer"])
    if any(_fsdp2(c) for c in chunks):
        from primus.megatron.fsdp import optimizer_state_as_dtensors

        optimizer_state_as_dtensors(optimizer)
    compat.restore_adam_step(optimizer, state["optimizer"])


def load_model_state(chunk: Any, state: dict[str, Any]) -> None:
    """``state`` into ``chunk``: all of it, or a LoRA checkpoint's adapters (the frozen base stays as built)."""
    from primus.megatron.lora import MARK

    adapters_only = bool(state) and all(MARK in k for k in state)
    result = chunk.load_state_dict(state, strict=not adapters_only)
    if adapters_only and (missing := [k for k in result.missing_keys if MARK in k]):
        raise RuntimeError(f"the checkpoint lacks adapters {missing[:4]} ({len(missing)} in all)")


def check_compatible(path: Path, cfg: PrimusConfig) -> dict[str, Any]:
    """The manifest of ``path``; refuses a checkpoint of another model shape, naming both."""
    return core.check_compatible(path, cfg, "primus-megatron")


def write_weights(folder: Path, chunks: list[Any]) -> None:
    """This rank's shards of the model alone into ``folder`` (core commits it: ``train.save_initial``); any layout
    loads it (:func:`load_seed`)."""
    from megatron.core import dist_checkpointing

    compat.checkpoint_writer_dies_with_rank()
    dist_checkpointing.save({"model": _model_sd(chunks, whole=True)}, str(folder))


def save_seed(path: Path, chunks: list[Any], rank: int, man: dict[str, Any]) -> None:
    """The model alone, committed with its manifest (``weights_only``: core's record) by this process (``primus
    checkpoint import``)."""
    core.atomic_save(path, man, rank, lambda tmp: write_weights(tmp, chunks), _barrier)
    log.info("saved seed checkpoint %s", path)


def load_seed(path: Path, chunks: list[Any], cfg: PrimusConfig) -> None:
    from megatron.core import dist_checkpointing

    check_compatible(path, cfg)
    state = dist_checkpointing.load({"model": _model_sd(chunks, whole=True)}, str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model"][f"chunk{i}"])
    log.info("loaded seed checkpoint %s", path)
