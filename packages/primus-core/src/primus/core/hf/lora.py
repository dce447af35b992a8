"""Low-rank adapters (``train.lora``): what they are, named and drawn once for every engine.

Adapters are held in the Hugging Face layout PEFT writes: for a targeted projection ``model.layers.{i}.self_attn.
q_proj`` (``W`` [out, in]), ``...q_proj.lora_A.weight`` [rank, in] and ``...q_proj.lora_B.weight`` [out, rank], and
the projection computes ``W x + scaling · B A dropout(x)``. An engine keeps these tensors as they are, whatever its
own layout of ``W`` (fused QKV, fused gate/up, RoPE-permuted rows, tensor-parallel shards): it maps the adapter's
*output features* into its layout (:func:`delta` gives them in the HF order) and, for a projection whose input is
sharded, takes the columns of ``A`` it holds. So both engines train the same tensors from the same initial values,
and an adapter exports to PEFT (:mod:`primus.core.hf.peft`) by name alone.

Initial values are PEFT's (``init_lora_weights=True``): ``A`` ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform with
a = sqrt(5)), ``B`` = 0, drawn here from a generator seeded by (``train.seed``, name), so every engine and layout
starts from the same adapters.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any, NamedTuple

from primus.core.config.schema import LORA_TARGETS
from primus.core.hf.contract import layer_names, shapes

if TYPE_CHECKING:
    import torch

    from primus.core.config.schema import LoRAConfig, ModelConfig, PrimusConfig

A, B = "lora_A", "lora_B"


class Adapter(NamedTuple):
    """One targeted projection of layer ``layer``: its HF module name (``model.layers.0.self_attn.q_proj``), its
    ``role`` in :func:`~primus.core.hf.contract.layer_names` (``q``), and the shape of its weight ``[out, in]``."""

    module: str
    layer: int
    role: str
    out_features: int
    in_features: int

    def name(self, which: str) -> str:
        """The HF / PEFT name (without PEFT's ``base_model.model.`` prefix) of ``lora_A`` or ``lora_B``."""
        return f"{self.module}.{which}.weight"

    def shape(self, which: str, rank: int) -> tuple[int, int]:
        return (rank, self.in_features) if which == A else (self.out_features, rank)


def adapters(m: ModelConfig, lora: LoRAConfig) -> list[Adapter]:
    """Every adapted projection, layer by layer in ``lora.target_modules``' canonical order (:data:`LORA_TARGETS`);
    in a mixture-of-experts layer, its attention's (the routed experts are not adapted, as PEFT adapts none of
    transformers 5's fused experts)."""
    weights = shapes(m)
    out = []
    for i in range(m.num_layers):
        names = layer_names(m, i)
        for module, role in LORA_TARGETS.items():
            # a mixture-of-experts layer has no dense gate / up / down: its MLP targets match nothing (as in PEFT)
            if module in lora.target_modules and role in names:
                weight = names[role]
                (o, n), _ = weights[weight]
                out.append(Adapter(weight.removesuffix(".weight"), i, role, o, n))
    return out


def targets(m: ModelConfig, lora: LoRAConfig) -> list[str]:
    """The ``target_modules`` that adapt a projection of ``m`` (``adapter_config.json``'s): on a model whose every
    layer routes its MLP to experts, the attention's alone. PEFT would take the MLP's names to transformers 5's fused
    experts, which Primus does not adapt."""
    roles = {a.role for a in adapters(m, lora)}
    return [t for t in lora.target_modules if LORA_TARGETS[t] in roles]


def tensor_names(m: ModelConfig, lora: LoRAConfig) -> list[str]:
    """Every adapter tensor's HF name: each projection's ``lora_A`` then its ``lora_B``."""
    return [a.name(which) for a in adapters(m, lora) for which in (A, B)]


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"lora/{seed}/{name}".encode()).digest()[:8], "little") >> 1


def initial(adapter: Adapter, which: str, lora: LoRAConfig, seed: int) -> torch.Tensor:
    """The initial value (fp32, CPU) of ``adapter``'s ``lora_A`` or ``lora_B``."""
    import torch

    shape = adapter.shape(which, lora.rank)
    if which == B:
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(adapter.in_features)
    gen = torch.Generator().manual_seed(_seed(seed, adapter.name(which)))
    return torch.rand(shape, generator=gen).mul_(2 * bound).sub_(bound)


def initial_tensors(cfg: PrimusConfig) -> dict[str, torch.Tensor]:
    """HF name -> initial value of every adapter of ``cfg`` (``train.lora`` set)."""
    lora = cfg.train.lora
    assert lora is not None
    return {a.name(w): initial(a, w, lora, cfg.train.seed) for a in adapters(cfg.model, lora) for w in (A, B)}


def delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, dropout: Any = None) -> torch.Tensor:
    """``scaling · B A dropout(x)``: the adapter's output features in the HF order of its projection's rows.
    ``dropout``: a module or function applied to ``x`` (training), or None."""
    import torch.nn.functional as F

    if dropout is not None:
        x = dropout(x)
    return F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * scaling


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling · B A`` in ``weight``'s dtype, computed in fp32 (PEFT's ``merge_and_unload``)."""
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)


def _sum_grad_fn() -> Any:
    import torch

    class SumGrad(torch.autograd.Function):
        """Identity forward; backward sums the gradient over ``group``: for a tensor every rank of the group holds
        whole (an adapter under tensor parallelism) whose gradient each rank computes from its part only."""

        @staticmethod
        def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
            ctx.group = group
            return t.view_as(t)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            import torch.distributed as dist

            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    return SumGrad


_SUM_GRAD: Any = None


def sum_grad_over(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t`` itself, whose gradient is summed over the process group ``group`` in backward (no-op for a group of
    one or None)."""
    global _SUM_GRAD
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return t
    if _SUM_GRAD is None:
        _SUM_GRAD = _sum_grad_fn()
    return _SUM_GRAD.apply(t, group)


def counts(cfg: PrimusConfig) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model with ``train.lora``'s adapters, whatever the engine or
    layout: the adapters' ``rank · (in + out)`` each, beside every HF tensor of the base."""
    lora = cfg.train.lora
    assert lora is not None
    trainable = sum(lora.rank * (a.in_features + a.out_features) for a in adapters(cfg.model, lora))
    base = sum(math.prod(shape) for shape, _ in shapes(cfg.model).values())
    return trainable, base + trainable


def describe(cfg: PrimusConfig) -> str:
    """The run's start line of what trains (both engines log it, rank 0)."""
    lora = cfg.train.lora
    assert lora is not None
    trainable, total = counts(cfg)
    return (
        f"LoRA: {trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.2f}%): rank {lora.rank}, "
        f"alpha {lora.alpha:g}, {', '.join(targets(cfg.model, lora))}; the base frozen in {cfg.train.precision}"
    )
