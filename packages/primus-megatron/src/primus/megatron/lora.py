"""LoRA on megatron-core (``train.lora``): the base model frozen as built, core's adapters added to its linears.

The adapters are core's tensors in PEFT's Hugging Face layout (:mod:`primus.core.hf.lora`): ``A`` [rank, in] and
``B`` [out, rank] of each targeted HF projection, held whole on every rank (tensor-parallel ranks too) as fp32
parameters of a child module ``lora`` of the megatron linear they adapt (checkpoint key
``decoder.layers.self_attention.linear_qkv.lora.q_proj.lora_A``: one tensor, replicated over TP like a norm's), and
added to the linear's output by a forward hook. In a bf16 run the frozen base stays bf16 and the adapters fp32 (their
own master weights: megatron's optimizer keeps fp32 parameters as they are); the delta is computed in the input's
dtype, as PEFT does.

Megatron's layout of the linears' output features (:mod:`primus.megatron.hf`):

- ``linear_qkv`` (column-parallel) is q, k and v interleaved per query group, a TP rank holding its groups: each
  projection's delta from the rows of ``B`` of this rank's groups, interleaved as :func:`~primus.megatron.hf.fuse_qkv`
  orders rows (a projection not targeted adds zeros);
- ``linear_fc1`` (column-parallel) is ``[gate shard; up shard]`` on each TP rank;
- ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj) are row-parallel: a rank holds a slice of the input
  features, so it applies its columns of ``A`` and ``A x`` is summed over TP before ``B``.

Tensor parallelism: a column-parallel adapter sees the linear's whole input (copied into the TP region, or gathered
from the sequence-parallel shards), so the input's gradient is summed (or reduce-scattered) over TP as the base
linear's is; each rank's ``A`` and ``B`` gradients come from its output features only and are summed over TP
(:func:`primus.core.hf.lora.sum_grad_over`). A row-parallel adapter's ``A x`` is all-reduced (or reduce-scattered
to the sequence shards); ``A``'s gradient is this rank's columns only (summed over TP), ``B``'s is whole without
sequence parallelism and this rank's tokens' part with it (summed over TP).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from primus.core.config.schema import LORA_TARGETS, PrimusConfig
from primus.core.hf import lora as core

# the megatron linear of a TransformerLayer -> the HF projections it fuses, in its order of output features
LINEARS = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
ROW_PARALLEL = frozenset({"self_attention.linear_proj", "mlp.linear_fc2"})
MARK = ".lora."  # in the state-dict key of every adapter tensor, and of nothing else


class Projection(nn.Module):
    """One HF projection's adapters, ``lora_A`` [rank, in] and ``lora_B`` [out, rank]. Its forward is called (the
    delta on this rank): megatron's DDP, with ``overlap_param_gather``, waits for a parameter's all-gather in a
    forward pre-hook of the module holding it, and a module never called would train on stale shards."""

    def __init__(self, rank: int, out: int, n: int, device: Any) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.zeros(rank, n, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out, rank, device=device))

    def forward(self, x: torch.Tensor, owner: LoRA) -> torch.Tensor:
        return (
            owner.row_delta(x, self.lora_A, self.lora_B)
            if owner.row
            else owner.column_delta(x, self.lora_A, self.lora_B)
        )


class LoRA(nn.ModuleDict):
    """The adapters of one megatron linear: a :class:`Projection` for each targeted HF projection it fuses (keyed
    ``q_proj`` ...), and the delta they add to its output (:meth:`hook`)."""

    def __init__(self, linear: nn.Module, path: str, shapes: dict[str, tuple[int, int]], cfg: PrimusConfig) -> None:
        super().__init__()
        from megatron.core.parallel_state import get_tensor_model_parallel_group

        lora = cfg.train.lora
        assert lora is not None
        self.fused = LINEARS[path]
        self.row = path in ROW_PARALLEL
        self.scaling = lora.scaling
        self.p = lora.dropout  # (functional: a module attribute would join this dict)
        self.group = getattr(linear, "tp_group", None) or get_tensor_model_parallel_group()
        self.tp = torch.distributed.get_world_size(self.group) if torch.distributed.is_initialized() else 1
        self.t = torch.distributed.get_rank(self.group) if self.tp > 1 else 0
        self.sp = bool(getattr(linear, "sequence_parallel", False)) and self.tp > 1
        self.out_rows = {hf: out for hf, (out, _) in shapes.items()}  # HF rows of every fused projection
        # query groups of this TP rank (linear_qkv); 1 for fc1's [gate; up]
        self.groups = cfg.model.num_kv_heads // self.tp if path.endswith("linear_qkv") else 1
        for hf, (out, n) in shapes.items():
            if hf in lora.target_modules:
                self[hf] = Projection(lora.rank, out, n, linear.weight.device)

    def dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, self.training)

    @property
    def _dropout(self) -> Any:
        return self.dropout if self.p else None

    def hook(self, _module: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        if self.row:
            delta = self[self.fused[0]](x, self)
        else:
            delta = self._fused(self._whole_input(x))
        return (out + delta.to(out.dtype), bias)

    def _whole_input(self, x: torch.Tensor) -> torch.Tensor:
        """A column-parallel linear's input as every TP rank's adapters see it: gathered from the sequence shards,
        or copied into the TP region (its gradient summed over TP in backward)."""
        from megatron.core.tensor_parallel import mappings

        if self.sp:
            return mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=self.group)
        return mappings.copy_to_tensor_model_parallel_region(x, group=self.group) if self.tp > 1 else x

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        """The delta of this rank's output features of a column-parallel linear, in its fused order."""
        parts = []
        for hf in self.fused:
            if hf in self:
                parts.append(self[hf](x, self))
            else:  # not targeted: nothing added to its rows
                parts.append(x.new_zeros(*x.shape[:-1], self.out_rows[hf] // self.tp))
        if len(parts) == 1:
            return parts[0]
        # per group: [its q rows, k rows, v rows] (linear_qkv), or [gate; up] as one group (linear_fc1)
        grouped = [p.unflatten(-1, (self.groups, -1)) for p in parts]
        return torch.cat(grouped, dim=-1).flatten(-2)

    def column_delta(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """One projection's delta on this rank's rows of it, from the whole input ``x``."""
        rows = b.shape[0] // self.tp
        a, b = core.sum_grad_over(a, self.group), core.sum_grad_over(b, self.group)
        return core.delta(x, a, b[self.t * rows : (self.t + 1) * rows], self.scaling, self._dropout)

    def row_delta(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """A row-parallel linear's delta from this rank's input features ``x`` (its columns of A)."""
        from megatron.core.tensor_parallel import mappings
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        if self.tp == 1:
            return core.delta(x, a, b, self.scaling, self._dropout)
        cols = a.shape[1] // self.tp
        a = core.sum_grad_over(a, self.group)[:, self.t * cols : (self.t + 1) * cols]
        if self.sp:  # each rank's B gradient is from its own tokens
            b = core.sum_grad_over(b, self.group)
        with get_cuda_rng_tracker().fork():  # this rank's input features: megatron's per-TP-rank RNG
            h = F.linear(self.dropout(x), a.to(x.dtype))
        if self.sp:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.group)
        else:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.group)
        # core.delta's B step, after the sum over the input's shards
        return F.linear(h, b.to(h.dtype)) * self.scaling


def _layers(chunk: nn.Module) -> list[nn.Module]:
    decoder = getattr(chunk, "decoder", None)
    return list(decoder.layers) if decoder is not None else []


def _submodule(layer: nn.Module, path: str) -> nn.Module | None:
    obj: Any = layer
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def modules(chunks: list[nn.Module]) -> list[tuple[int, str, LoRA]]:
    """(global layer, megatron linear path, its adapters) of every adapted linear in ``chunks``."""
    out = []
    for chunk in chunks:
        for layer in _layers(chunk):
            for path in LINEARS:
                linear = _submodule(layer, path)
                if linear is not None and isinstance(getattr(linear, "lora", None), LoRA):
                    out.append((layer.layer_number - 1, path, linear.lora))
    return out


def initial_values(cfg: PrimusConfig) -> Callable[[core.Adapter, str], torch.Tensor]:
    """An adapter tensor's initial value: from ``train.lora.init_from`` (a PEFT folder), else core's (PEFT's init,
    drawn from train.seed by name: the same on every engine and layout)."""
    lora = cfg.train.lora
    assert lora is not None
    if lora.init_from:
        from primus.core.hf.peft import read_adapter

        tensors = read_adapter(lora.init_from, cfg)
        return lambda adapter, which: tensors[adapter.name(which)]
    return lambda adapter, which: core.initial(adapter, which, lora, cfg.train.seed)


def attach(chunks: list[nn.Module], cfg: PrimusConfig, initialise: bool = True) -> None:
    """Freeze every parameter of ``chunks`` and add ``train.lora``'s adapters to the targeted linears of their
    decoder layers: at their initial values (``initialise``), or zeros that a checkpoint then fills."""
    from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes

    lora = cfg.train.lora
    assert lora is not None
    by_layer: dict[int, dict[str, core.Adapter]] = {}
    for adapter in core.adapters(cfg.model, lora):
        by_layer.setdefault(adapter.layer, {})[adapter.module.rsplit(".", 1)[1]] = adapter
    value = initial_values(cfg) if initialise else None
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for layer in _layers(chunk):
            i = layer.layer_number - 1
            wanted = by_layer.get(i, {})
            for path, fused in LINEARS.items():
                linear = _submodule(layer, path)
                if linear is None or not any(hf in wanted for hf in fused):
                    continue
                shapes = {hf: _shape(cfg, hf, i) for hf in fused}
                module = LoRA(linear, path, shapes, cfg)
                linear.add_module("lora", module)
                linear.register_forward_hook(module.hook, with_kwargs=True)
                for param in module.parameters():
                    set_defaults_if_not_set_tensor_model_parallel_attributes(param)  # whole on every TP rank
                if value is not None:
                    with torch.no_grad():
                        for hf, projection in module.items():
                            projection.lora_A.copy_(value(wanted[hf], core.A))
                            projection.lora_B.copy_(value(wanted[hf], core.B))
        if cfg.parallel.recompute == "full":
            _input_requires_grad(chunk)


def _shape(cfg: PrimusConfig, hf: str, layer: int) -> tuple[int, int]:
    """[out, in] of HF projection ``hf`` in ``layer`` (a mixture-of-experts model's dense MLP need not be layer 0's)."""
    from primus.core.hf.contract import layer_names, shapes

    (out, n), _ = shapes(cfg.model)[layer_names(cfg.model, layer)[LORA_TARGETS[hf]]]
    return out, n


def _input_requires_grad(chunk: nn.Module) -> None:
    """Full recompute checkpoints each layer with an autograd function whose only tensor input is the hidden
    state: from a frozen embedding that needs no gradient, and the recomputed adapters would get none. The
    embedding's output asks for one (PEFT's ``enable_input_require_grads``)."""
    embedding = getattr(chunk, "embedding", None)
    if embedding is not None:
        embedding.register_forward_hook(lambda _m, _a, out: out.requires_grad_() if torch.is_grad_enabled() else out)


def only_adapters(sd: dict) -> dict:
    """A chunk's (sharded) state dict cut to its adapters: a LoRA checkpoint holds them, not the frozen base, which
    a resume rebuilds as the run started (train.init_from or the canonical init)."""
    return {k: v for k, v in sd.items() if MARK in k}


@torch.no_grad()
def hf_adapters(chunks: list[nn.Module], cfg: PrimusConfig) -> dict[str, torch.Tensor]:
    """HF name -> fp32 CPU value of every adapter in ``chunks`` (the whole model: one rank, no pipeline)."""
    from primus.core.hf.contract import layer_names

    assert cfg.train.lora is not None
    out = {}
    for layer, _path, module in modules(chunks):
        names = layer_names(cfg.model, layer)
        for hf, projection in module.items():
            stem = names[LORA_TARGETS[hf]].removesuffix(".weight")
            out[f"{stem}.{core.A}.weight"] = projection.lora_A.detach().float().cpu().clone()
            out[f"{stem}.{core.B}.weight"] = projection.lora_B.detach().float().cpu().clone()
    return {name: out[name] for name in core.tensor_names(cfg.model, cfg.train.lora)}
