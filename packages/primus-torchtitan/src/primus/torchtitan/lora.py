"""LoRA (``train.lora``) on TorchTitan's model: core's adapters (:mod:`primus.core.hf.lora`: PEFT's HF layout, its
initial values, the delta) on torchtitan's linears, through its parallelize (TP plan, FSDP2, activation
checkpointing, compile, pipeline stages).

Each targeted linear (``attention.wq / wk / wv / wo``, ``feed_forward.w1 / w3 / w2``: HF's q / k / v / o_proj,
gate / up / down_proj) gets a sibling module ``{linear}_lora`` (:class:`LoRA`: ``lora_A`` [rank, in] and ``lora_B``
[out, rank], fp32, trainable) and a forward hook on the linear adding ``scaling · B A dropout(x)`` to its output. A
sibling, not a child: TorchTitan's TP plan shards every parameter of a linear it parallelizes. The adapters join
their block's FSDP group (sharded and gathered with it) and its activation checkpoint and compiled region.

Layout: the adapter's output features are HF's rows; torchtitan's llama3 permutes the q / k rows (its RoPE pairs
are interleaved, HF's are halves), so ``B``'s rows are taken in torchtitan's order (:attr:`Target.rows`, read off
the state-dict adapter's own ``from_hf``: qwen3's permutes nothing). Under TP the hook runs before the plan's own
output hook, on the linear's DTensor output: a column-parallel linear's are the rank's output features (it takes
the rank's rows of ``B``), a row-parallel one's (``wo``, ``w2``) a partial sum over the rank's input features (it
takes the rank's columns of ``A``; its partial delta is reduced with the linear's). Every TP rank holds both
adapters whole and computes their gradients from its part: core's :func:`~primus.core.hf.lora.sum_grad_over` sums
them over the TP group.

The base is frozen (``requires_grad`` False: torchtitan's optimizer and FSDP's gradient reduction skip it) and held
at the compute dtype (bf16 in a bf16 run: FSDP2's mixed precision casts nothing for it and no fp32 copy exists;
FSDP2 asks a uniform dtype of the trainable parameters only). Checkpoints hold the adapters, not the base
(:func:`is_adapter`): a resume rebuilds the base as the run started, from ``train.init_from`` or the canonical init.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from primus.core.config.schema import LoRAConfig, PrimusConfig
from primus.core.hf import lora as core

log = logging.getLogger("primus.torchtitan.lora")

SUFFIX = "_lora"  # the sibling of linear ``wq`` is ``wq_lora``
#: the roles torchtitan's TP plan shards by input feature (RowwiseParallel: wo, w2); the others by output feature
ROW_PARALLEL = frozenset({"o", "down"})
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Target:
    """One adapted linear: core's adapter, the linear's module path in torchtitan's model, and ``rows``: torchtitan's
    row ``i`` of the weight is HF's row ``rows[i]`` (None where the order is HF's)."""

    adapter: core.Adapter
    path: str
    rows: torch.Tensor | None

    def key(self, which: str) -> str:
        """The model state-dict key of ``lora_A`` / ``lora_B`` (``layers.0.attention.wq_lora.lora_A``)."""
        return f"{self.path}{SUFFIX}.{which}"


def is_adapter(key: str) -> bool:
    """Whether a model state-dict key is an adapter's (what a LoRA run's checkpoints hold of the model)."""
    return key.endswith((f"{SUFFIX}.{core.A}", f"{SUFFIX}.{core.B}"))


def targets(cfg: PrimusConfig) -> list[Target]:
    """Every adapted linear of ``cfg`` (``train.lora`` set), in core's order, mapped through the state-dict adapter
    that loads HF weights into the model (:func:`primus.torchtitan.state_dict.adapter`): the linear's name and its row order.
    """
    from primus.core.hf.contract import EMBED
    from primus.torchtitan.state_dict import adapter

    assert cfg.train.lora is not None
    ad, m = adapter(cfg), cfg.model
    tied = {EMBED: torch.zeros(1)} if m.tie_word_embeddings else {}  # tied adapters look for the embedding
    by_role: dict[str, tuple[str, torch.Tensor | None]] = {}
    out = []
    for a in core.adapters(m, cfg.train.lora):
        if a.role not in by_role:  # the same mapping in every layer: found once, on row numbers
            ids = torch.arange(a.out_features, dtype=torch.float32)[:, None].expand(a.out_features, a.in_features)
            ((key, rows),) = [
                (k, v) for k, v in ad.from_hf({f"{a.module}.weight": ids, **tied}).items() if k.startswith("layers.")
            ]
            rows = rows[:, 0].long()
            same = torch.equal(rows, torch.arange(a.out_features))
            template = key.removesuffix(".weight").replace(f"layers.{a.layer}.", "layers.{}.", 1)
            by_role[a.role] = (template, None if same else rows)
        template, rows = by_role[a.role]
        out.append(Target(a, template.format(a.layer), rows))
    return out


class LoRA(nn.Module):
    """The adapters of one linear (see the module's docstring); :meth:`hook` is the linear's forward hook."""

    def __init__(self, target: Target, lora: LoRAConfig, device: torch.device) -> None:
        super().__init__()
        a, r = target.adapter, lora.rank
        self.lora_A = nn.Parameter(torch.empty(r, a.in_features, device=device, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.empty(a.out_features, r, device=device, dtype=torch.float32))
        self.scaling = lora.scaling
        self.dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else None
        self.target = target
        self.row_parallel = target.adapter.role in ROW_PARALLEL
        # index tensors (plain attributes: no state), moved to the device by place(): B's rows in torchtitan's
        # order, and under TP the rank's rows of B (column-parallel) or columns of A (row-parallel)
        self.rows = target.rows
        self.local: torch.Tensor | None = None
        self.tp_group: Any = None

    def place(self, device: torch.device, tp_mesh: Any = None) -> None:
        """This rank's part of the linear (after parallelize): the indices on ``device``, the TP group."""
        if tp_mesh is not None:
            self.tp_group = tp_mesh.get_group()
            n = self.lora_A.shape[1] if self.row_parallel else self.lora_B.shape[0]
            mine = torch.arange(n).chunk(tp_mesh.size())[tp_mesh.get_local_rank()]  # DTensor's Shard split
            self.local = mine if self.row_parallel or self.rows is None else self.rows[mine]
            self.local = self.local.to(device)
        if self.rows is not None:
            self.rows = self.rows.to(device)

    def hook(self, linear: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        x, a, b = args[0], self.lora_A, self.lora_B
        if self.tp_group is None:
            if self.rows is not None:
                b = b.index_select(0, self.rows)
            return out + core.delta(x, a, b, self.scaling, self.dropout)
        from torch.distributed.tensor import DTensor, Partial

        a, b = core.sum_grad_over(a, self.tp_group), core.sum_grad_over(b, self.tp_group)
        if self.dropout is not None:  # on the DTensor: a replicated input is dropped alike on every TP rank
            x = self.dropout(x)
        if self.row_parallel:  # the rank's input features: their gradient is this rank's alone
            x, a = x.to_local(), a.index_select(1, self.local)
            if self.rows is not None:
                b = b.index_select(0, self.rows)
        else:  # the whole input: its gradient from this rank's output features is a part of the whole
            x, b = x.to_local(grad_placements=[Partial()]), b.index_select(0, self.local)
        d = core.delta(x, a, b, self.scaling)
        return out + DTensor.from_local(d, out.device_mesh, out.placements, run_check=False)


def attach(model: nn.Module, cfg: PrimusConfig, found: list[Target]) -> int:
    """Freeze ``model``'s parameters at the compute dtype and add the adapters of the linears it holds (a pipeline
    stage holds some layers). Before torchtitan's parallelize, on the meta device. Returns the linears adapted."""
    assert cfg.train.lora is not None
    dtype = DTYPES[cfg.train.precision]
    for p in model.parameters():
        p.requires_grad_(False)
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    n = 0
    for t in found:
        try:
            linear = model.get_submodule(t.path)
        except AttributeError:
            continue  # a layer of another pipeline stage
        parent, name = t.path.rsplit(".", 1)
        module = LoRA(t, cfg.train.lora, linear.weight.device)
        model.get_submodule(parent).register_module(name + SUFFIX, module)
        linear.register_forward_hook(module.hook)  # before the TP plan's: it sees the linear's DTensor output
        n += 1
    return n


def parallelize_with_adapters(parallelize_fn: Callable[..., nn.Module], cfg: PrimusConfig) -> Callable[..., nn.Module]:
    """A TrainSpec ``parallelize_fn`` that freezes the base and attaches the adapters (:func:`attach`) first: torchtitan
    calls it on the meta model (or each pipeline stage) before TP, AC, compile and FSDP."""
    found = targets(cfg)

    def parallelize(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
        attach(model, cfg, found)
        model = parallelize_fn(model, parallel_dims, job_config)
        # torch's SequenceParallel makes the norms' replicated weights new parameters that require a gradient: frozen
        # again (before FSDP's lazy init and the optimizer read requires_grad)
        for name, p in model.named_parameters():
            p.requires_grad_(is_adapter(name))
        return model

    return parallelize


def initial_values(cfg: PrimusConfig) -> dict[str, torch.Tensor]:
    """HF name -> the adapters' starting values: ``train.lora.init_from``'s PEFT folder, or core's initial ones."""
    lora = cfg.train.lora
    assert lora is not None
    if lora.init_from:
        from primus.core.hf.peft import read_adapter

        return read_adapter(lora.init_from, cfg)
    return core.initial_tensors(cfg)


def with_adapters(spec: Any, cfg: PrimusConfig) -> Any:
    """The TrainSpec ``spec`` whose parallelize function attaches the adapters first (:func:`attach`)."""
    import dataclasses

    return dataclasses.replace(spec, parallelize_fn=parallelize_with_adapters(spec.parallelize_fn, cfg))


def setup(trainer: Any, cfg: PrimusConfig) -> None:
    """After the trainer is built: each adapter's part of the layout, its starting values (into this rank's shards).
    (What trains, its start line and its summary, is core's: :func:`primus.core.hf.lora.describe`.)"""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    dims = trainer.parallel_dims
    tp_mesh = dims.get_mesh("tp") if dims.tp_enabled else None
    values, options = initial_values(cfg), StateDictOptions(full_state_dict=True, strict=False)
    for part in trainer.model_parts:
        mine = {}
        for module in part.modules():
            if isinstance(module, LoRA):
                module.place(trainer.device, tp_mesh)
                t = module.target
                mine |= {t.key(w): values[t.adapter.name(w)] for w in (core.A, core.B)}
        set_model_state_dict(part, mine, options=options)  # whole tensors into this rank's shards


def checkpoint_keys(cfg: PrimusConfig) -> dict[str, tuple[str, tuple[int, int]]]:
    """Model state-dict key of every adapter in a checkpoint -> (its HF name, its shape)."""
    lora = cfg.train.lora
    assert lora is not None
    return {
        t.key(w): (t.adapter.name(w), t.adapter.shape(w, lora.rank)) for t in targets(cfg) for w in (core.A, core.B)
    }


def base_keys(checkpointer: Any) -> frozenset[str]:
    """The model keys a LoRA run's checkpoints leave out: the frozen base, which a resume rebuilds as the run
    started (``train.init_from`` or the canonical init) before the adapters are loaded."""
    from torchtitan.components.checkpoint import MODEL

    return frozenset(k for k in checkpointer.states[MODEL].state_dict() if not is_adapter(k))
