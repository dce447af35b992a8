"""A Megatron-LM torch_dist checkpoint (recognised by :mod:`primus.megatron.native`) loaded into the engine's model
chunks and optimizer, with megatron-core's ``dist_checkpointing.load``: any layout it was saved at (its tensors are
global), into the engine's.

Keys. Primus builds its own local layer spec (:mod:`primus.megatron.layer_spec`), whose norms are modules of their
own: ``input_layernorm``, ``pre_mlp_layernorm``, MLA's ``q_layernorm`` / ``kv_layernorm``. Megatron-LM's layer
specs name some of them after the linear they precede: Transformer Engine's (its default on GPUs) fuses them
(``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight`` of a dense MLP,
``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight`` in MLA; a MoE layer keeps its
``pre_mlp_layernorm``), and megatron-core's local spec (``--transformer-impl local``) saves its two block norms
under TE's names too (``sharded_state_dict_keys_map``). Each of this model's keys is looked up as it is, then under
those names (:data:`ALIASES`). A model whose layers differ (experts in some) has one key per layer
(``decoder.layers.{i}.…``), one whose layers are alike stacks them (``decoder.layers.…``, the layer a leading axis):
Primus always gives a model with experts per-layer keys, Megatron-LM stacks them when every layer has experts
(``--moe-layer-freq 1``); either form is read as the other. The routed experts are saved one tensor per expert
(``mlp.experts.experts.linear_fc1.weight``, the global expert a leading axis) by each of megatron's expert classes
(SequentialMLP, GroupedMLP, TEGroupedMLP: "interchangeable with SequentialMLP's" in megatron-core 0.16's
``experts.py``), which is also how Primus's ``StackedExperts`` reads them. Extra states (``_extra_state``: TE's FP8
metadata, empty elsewhere) are not read. A tensor of the checkpoint's model that this model has no place for, or one
of this model's that the checkpoint lacks, stops the import naming it.

The optimizer (unless ``weights_only``): per-parameter Adam state in model space, ``optimizer.state.<kind>.<model
key>`` (megatron's regular optimizer: ``exp_avg``, ``exp_avg_sq``, ``fp32_param`` where the model is bf16/fp16; the
distributed optimizer's ``fully_reshardable``: ``param``, ``exp_avg``, ``exp_avg_sq``), loaded under the same keys as
the model and put into this engine's optimizer (megatron's regular or distributed one); its update count (Adam's
bias correction) from the saved param groups. Where the checkpoint holds no fp32 master weights (an fp32 run's
regular optimizer) the model's fp32 weights are the masters.

The same reading takes a checkpoint of Primus's own one-process runs (megatron's regular optimizer: what an import
writes) into a run with the distributed optimizer, which megatron-core does not load as such
(:func:`read_regular_into_distributed`, from the engine's resume).
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from primus.core.contracts.errors import UserError
from primus.core.contracts.native import NativeCheckpoint
from primus.megatron.native import STATE_KEY, tensor_index

log = logging.getLogger("primus.megatron.native")

#: this model's key suffix -> the names Megatron-LM's layer specs may give the same tensor (module docstring)
ALIASES = {
    "input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight",),
    "pre_mlp_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight",),
    "self_attention.q_layernorm.weight": ("self_attention.linear_q_up_proj.layer_norm_weight",),
    "self_attention.kv_layernorm.weight": ("self_attention.linear_kv_up_proj.layer_norm_weight",),
}
_PER_LAYER = re.compile(r"^((?:decoder|mtp)\.layers\.)(\d+)\.(.+)$")
_STACKED = re.compile(r"^((?:decoder|mtp)\.layers\.)(?!\d+\.)(.+)$")
_STATE = "optimizer.state."
_KINDS = ("exp_avg", "exp_avg_sq", "param")


class _Keys:
    """The checkpoint's tensors (key -> global shape) and how this model's keys are found among them."""

    def __init__(self, index: dict[str, tuple[int, ...]]) -> None:
        self.index = index
        self.state: dict[tuple[str, str], str] = {}  # (kind, model key) -> the checkpoint's key of that state
        for key in index:
            if m := STATE_KEY.match(key):
                kind = "param" if m[1] == "fp32_param" else m[1]
                self.state[(kind, m[2])] = key
        self.model = {k for k in index if not k.startswith(("optimizer.", "chained_")) and "_extra_state" not in k}
        self.used: set[str] = set()

    def names(self, key: str) -> list[str]:
        """``key`` and its aliases."""
        out = [key]
        for suffix, aliases in ALIASES.items():
            if key.endswith("." + suffix) or key == suffix:
                out += [key[: len(key) - len(suffix)] + alias for alias in aliases]
        return out

    def find(self, sh: Any) -> tuple[str, Any] | None:
        """(the checkpoint's model key of this model's ShardedTensor ``sh``, ``sh`` in that key's form)."""
        for name in self.names(sh.key):
            if name in self.model:
                return name, replace(sh, key=name)
        per_layer, stacked = _PER_LAYER.match(sh.key), _STACKED.match(sh.key)
        if per_layer:  # ours per layer: the checkpoint's may stack the layers
            for name in self.names(per_layer[1] + per_layer[3]):
                if name in self.model:
                    return name, _add_layer_axis(sh, name, int(per_layer[2]), self.index[name][0])
        elif stacked and sh.prepend_axis_num > 0:  # ours stacked: the checkpoint's may be per layer
            layer = sh.global_offset[0]
            for name in self.names(f"{stacked[1]}{layer}.{stacked[2]}"):
                if name in self.model:
                    return name, _drop_layer_axis(sh, name)
        return None


def _add_layer_axis(sh: Any, key: str, layer: int, layers: int) -> Any:
    frag = None if sh.axis_fragmentations is None else (layers, *sh.axis_fragmentations)
    return replace(sh, key=key, global_shape=(layers, *sh.global_shape), global_offset=(layer, *sh.global_offset),
                   axis_fragmentations=frag, prepend_axis_num=sh.prepend_axis_num + 1)  # fmt: skip


def _drop_layer_axis(sh: Any, key: str) -> Any:
    frag = None if sh.axis_fragmentations is None else sh.axis_fragmentations[1:]
    return replace(sh, key=key, global_shape=sh.global_shape[1:], global_offset=sh.global_offset[1:],
                   axis_fragmentations=frag, prepend_axis_num=sh.prepend_axis_num - 1)  # fmt: skip


def _model_leaves(chunks: list[Any]) -> list[tuple[Any, torch.Tensor]]:
    """(ShardedTensor or ShardedTensorFactory, the tensor it holds) of every chunk's model state, once per tensor."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from primus.megatron.checkpoint import model_sharded_state_dict

    out, seen = [], set()
    for chunk in chunks:
        for leaf in nested_values(model_sharded_state_dict(chunk)):
            if isinstance(leaf, (ShardedTensor, ShardedTensorFactory)) and id(leaf.data) not in seen:
                seen.add(id(leaf.data))
                out.append((leaf, leaf.data))
    return out


def _trained(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad


def _request(leaf: Any, kind: str | None, buffer: bool) -> Any:
    """``leaf`` asking for its tensor's ``kind`` of state (None: the model weight) under this model's key (prefixed
    ``optimizer.state.<kind>.``; the checkpoint's names are found once the factories are built), into an fp32 buffer
    on the host (``buffer``; else the tensor itself stands in, for the checks that read nothing)."""
    key = leaf.key if kind is None else f"{_STATE}{kind}.{leaf.key}"
    if not buffer:
        return replace(leaf, key=key)
    data = torch.empty(leaf.data.shape, dtype=torch.float32)
    return replace(leaf, key=key, data=data, **({"dtype": torch.float32} if hasattr(leaf, "dtype") else {}))


def load(found: NativeCheckpoint, chunks: list[Any], optimizer: Any, weights_only: bool) -> None:
    """Load ``found``'s model into ``chunks`` (the engine's, unwrapped) and, unless ``weights_only``, its Adam state
    into ``optimizer`` (megatron's, over those chunks; its fp32 master weights follow the model either way)."""
    step = found.details.get("adam_step") or float(found.step)
    read(Path(found.folder), f"{found.folder} ({found.what})", chunks, optimizer, weights_only, step)


def read_regular_into_distributed(folder: Path, chunks: list[Any], optimizer: Any) -> None:
    """A checkpoint of megatron's regular optimizer (a one-process run's; ``primus checkpoint import`` writes one)
    into this run's distributed optimizer, which megatron-core 0.16 does not load as such: the regular optimizer keeps
    its state per model tensor (``optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<model key>``), so each rank reads
    its tensor-/pipeline-parallel part of each, as of the weights, and keeps its data-parallel range of it
    (:func:`read`)."""
    from primus.megatron.native import adam_step, read_common

    step = adam_step(read_common(folder))
    if step is None:
        raise ValueError(f"checkpoint {folder} records no optimizer update count (its Adam step)")
    read(folder, f"checkpoint {folder}", chunks, optimizer, weights_only=False, step=step)


def read(folder: Path, what: str, chunks: list[Any], optimizer: Any, weights_only: bool, step: float) -> None:
    """The model tensors of the torch_dist checkpoint ``folder`` into ``chunks`` and, unless ``weights_only``, its
    optimizer state in model space into ``optimizer`` with Adam's update count ``step`` (``what``: the checkpoint, in
    refusals). Every key is found (or the checkpoint refused) before anything is read; then one kind of state at a
    time is read into host buffers (the weights, then each of Adam's), so the host holds one fp32 copy of the model
    at most."""
    keys = _Keys(tensor_index(folder))
    leaves = _model_leaves(chunks)
    kinds: list[str | None] = [None]
    if not weights_only:
        kinds += [k for k in _KINDS if any(kind == k for kind, _ in keys.state)]
        if not {"exp_avg", "exp_avg_sq"} <= set(kinds):
            raise UserError(f"{what}: it holds no Adam moments per model tensor (optimizer.state.exp_avg.<key>)")
    missing: list[str] = []
    shapes = []
    for kind in kinds:
        requests, _ = _requests(keys, leaves, kind, missing, buffer=False)
        shapes += [(sh.key, sh.global_shape) for sh in _sharded_tensors(requests) if sh.key in keys.index]
    unused = sorted(keys.model - keys.used) if _whole_model() else []  # a pipeline stage holds its part
    if missing or unused:
        raise UserError(_mismatch(what, missing, unused))
    if bad := [(key, ours) for key, ours in shapes if tuple(ours) != keys.index[key]]:
        key, ours = bad[0]
        raise UserError(
            f"{what}: {key} is {list(keys.index[key])} there and {list(ours)} in this model (the model config differs "
            "from the checkpoint's: leave its model to the checkpoint)"
        )
    weights = _read(folder, *_requests(keys, leaves, None, missing, buffer=True))
    with torch.no_grad():
        for i, (_, tensor) in enumerate(leaves):
            tensor.copy_(weights[str(i)])
    optimizer.reload_model_params()  # fp32 master copies of bf16 weights, where the optimizer keeps them
    if weights_only:
        log.info("loaded %s: model weights", folder)
        return
    put = _optimizer_slots(optimizer, step)
    for kind in _KINDS:  # an fp32 run's regular optimizer keeps no master copies: the weights are the masters
        loaded = _read(folder, *_requests(keys, leaves, kind, missing, buffer=True)) if kind in kinds else weights
        with torch.no_grad():
            for i, (_, tensor) in enumerate(leaves):
                if id(tensor) in put:  # (a distributed optimizer's rank holds state of the tensors in its range)
                    put[id(tensor)](kind, loaded[str(i)])
        del loaded
    log.info("loaded %s: model and optimizer state (Adam step %d)", folder, int(step))


def _whole_model() -> bool:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size() == 1


def _requests(keys: _Keys, leaves: list, kind: str | None, missing: list[str], buffer: bool) -> tuple[dict, dict]:
    """(``leaves``' requests of ``kind``, by index, as the checkpoint names and shapes them; the factories they were
    built from), the keys it lacks added to ``missing``. Buffers (a router's expert bias) have no optimizer state."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories

    requests = {
        str(i): _request(leaf, kind, buffer)
        for i, (leaf, tensor) in enumerate(leaves)
        if kind is None or _trained(tensor)
    }
    factories, _ = extract_matching_values(requests, lambda x: isinstance(x, ShardedTensorFactory))
    apply_factories(requests)
    prefix = "" if kind is None else f"{_STATE}{kind}."

    def to_checkpoint(sh: Any) -> Any:
        if not isinstance(sh, ShardedTensor):
            return sh
        hit = keys.find(replace(sh, key=sh.key[len(prefix) :]))
        if hit is None:
            missing.append(sh.key)
            return sh
        name, theirs = hit
        if kind is None:
            keys.used.add(name)
            return theirs
        if (kind, name) not in keys.state:
            missing.append(f"{prefix}{name}")
            return sh
        return replace(theirs, key=keys.state[(kind, name)])

    dict_list_map_inplace(to_checkpoint, requests)
    return requests, factories


def _read(folder: Path, requests: dict, factories: dict) -> dict[str, torch.Tensor]:
    """``requests`` read from ``folder`` (megatron-core's ``dist_checkpointing.load``), the factories' parts merged:
    index -> the whole local tensor."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import apply_factory_merges

    loaded = dist_checkpointing.load({"primus_native": requests}, str(folder), validate_access_integrity=False)
    return apply_factory_merges(loaded["primus_native"], factories)


def _sharded_tensors(requests: dict) -> list[Any]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [v for v in nested_values(requests) if isinstance(v, ShardedTensor)]


def _mismatch(what: str, missing: list[str], unused: list[str]) -> str:
    def some(keys: list[str]) -> str:
        return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")

    said = []
    if missing:
        said.append(f"it lacks this model's {some(missing)}")
    if unused:
        said.append(f"this model has no place for its {some(unused)} (a layer spec or feature Primus does not build)")
    return f"{what}: {'; '.join(said)}"


def _optimizer_slots(optimizer: Any, step: float) -> dict[int, Any]:
    """Model parameter ``id`` -> ``put(kind, whole)``, which writes that parameter's ``kind`` of Adam state
    (``param``: the fp32 master, ``exp_avg``, ``exp_avg_sq``; ``whole``: its local tensor, fp32) into megatron's
    optimizer: the regular one (the state of its torch optimizer's parameter: a bf16 model's fp32 copy, else the
    parameter itself) or the distributed one (this rank's range of it). The state is made first, its update count
    ``step`` set (torch's Adam: a tensor a parameter, on its device where fused)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from primus.megatron import compat

    compat.prepare_optimizer_for_load(optimizer)  # the distributed optimizer's state, to be overwritten
    slots: dict[int, Any] = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if opt.optimizer is None:
            continue
        if isinstance(opt, DistributedOptimizer):
            for model_param in opt.model_param_group_index_map:
                rng = opt._get_model_param_range_map(model_param)["param"]
                targets = opt._get_main_param_and_optimizer_states(model_param)
                slots[id(model_param)] = functools.partial(_put_range, targets, rng.start, rng.end)
        else:
            if opt.init_state_fn is not None:
                opt.init_state_fn(opt.optimizer, opt.config)
            for model_param, main in _regular_pairs(opt):
                slots[id(model_param)] = functools.partial(_put_whole, {"param": main, **opt.optimizer.state[main]})
        for group in opt.optimizer.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for p in group["params"]:
                device = p.device if on_device else "cpu"
                opt.optimizer.state[p]["step"] = torch.tensor(step, dtype=torch.float32, device=device)
    return slots


def _put_whole(targets: dict[str, torch.Tensor], kind: str, whole: torch.Tensor) -> None:
    targets[kind].copy_(whole)


def _put_range(targets: dict[str, torch.Tensor], start: int, end: int, kind: str, whole: torch.Tensor) -> None:
    targets[kind].copy_(whole.reshape(-1)[start:end])


def _regular_pairs(opt: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model parameter, the parameter its torch optimizer steps) of megatron's regular optimizer: a bf16/fp16
    model's fp32 copy (Float16OptimizerWithFloat16Params), else the parameter itself."""
    pairs = []
    if hasattr(opt, "float16_groups"):
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
            pairs += list(zip(model_group, main_group, strict=True))
        for group in opt.fp32_from_fp32_groups:
            pairs += [(p, p) for p in group]
    else:
        pairs = [(p, p) for g in opt.optimizer.param_groups for p in g["params"]]
    return pairs
