"""One tensor-parallel rank's shapes of a block's linears, by engine-neutral role: what FP8's shape rule
(:func:`~primus.core.kernels.fp8_recipe.fp8_linear_rule`) weighs, for the planner and both engines alike.

Roles: attention ``q``, ``k``, ``v``, ``o`` (latent attention's: :func:`primus.core.config.deepseek.attention_linears`),
a SwiGLU MLP's ``gate``, ``up``, ``down``. An engine that runs some of them as one GEMM names the groups (its planner
profile's ``gemm_groups``; megatron: ``linear_qkv``, ``linear_fc1``) and gets the group's shape (:func:`fused`); each
engine maps the roles to its own module names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, NamedTuple

from primus.core.config import deepseek

if TYPE_CHECKING:
    from primus.core.config.schema import ModelConfig


class RankLinear(NamedTuple):
    """One rank's ``(in_features, out_features)``, and how tensor parallelism splits the linear: ``column`` (its
    outputs), ``row`` (its inputs) or ``whole`` (every rank holds all of it: latent attention's down projections)."""

    in_features: int
    out_features: int
    split: Literal["column", "row", "whole"]

    @property
    def shape(self) -> tuple[int, int]:
        return self.in_features, self.out_features


def _split(in_features: int, out_features: int, split: str, tp: int) -> RankLinear:
    if split == "row":
        return RankLinear(in_features // tp, out_features, split)
    if split == "column":
        return RankLinear(in_features, out_features // tp, split)
    return RankLinear(in_features, out_features, split)


def attention_linears(model: ModelConfig, tp: int = 1) -> dict[str, RankLinear]:
    """Role -> one rank's shape of a block's attention linears: ``q``, ``k``, ``v``, ``o``, or latent attention's
    roles (its down projections :data:`~primus.core.config.deepseek.WHOLE_UNDER_TP` whole, ``o`` row-wise, the
    others column-wise)."""
    if model.mla is not None:
        return {
            role: _split(i, o, "whole" if role in deepseek.WHOLE_UNDER_TP else "row" if role == "o" else "column", tp)
            for role, (i, o) in deepseek.attention_linears(model).items()
        }
    d, q, kv = model.hidden_size, model.num_attention_heads * model.kv_channels, model.num_kv_heads * model.kv_channels
    whole = {"q": (d, q, "column"), "k": (d, kv, "column"), "v": (d, kv, "column"), "o": (q, d, "row")}
    return {role: _split(*shape, tp) for role, shape in whole.items()}


def mlp_linears(model: ModelConfig, width: int, tp: int = 1) -> dict[str, RankLinear]:
    """Role -> one rank's shape of a SwiGLU MLP of inner ``width`` (a dense MLP's ``ffn_hidden_size``, shared
    experts' summed width): ``gate``, ``up`` column-wise, ``down`` row-wise; none at width 0."""
    d = model.hidden_size
    whole = {"gate": (d, width, "column"), "up": (d, width, "column"), "down": (width, d, "row")}
    return {role: _split(*shape, tp) for role, shape in whole.items()} if width else {}


def head_linear(model: ModelConfig, tp: int = 1) -> RankLinear:
    """One rank's shape of the output projection: column-wise, a slice of the vocabulary."""
    return _split(model.hidden_size, model.vocab_size, "column", tp)


def shared_expert_width(model: ModelConfig) -> int:
    """The summed inner width of an MoE layer's shared experts (0: none), run as one MLP on both engines."""
    return model.moe.shared_experts * model.moe.expert_ffn_hidden_size if model.moe else 0


def fused(linears: Mapping[str, RankLinear], groups: Mapping[str, tuple[str, ...]]) -> dict[str, RankLinear]:
    """``linears`` with each group of ``groups`` (name -> roles sharing an input, split alike) as one GEMM of their
    summed outputs, named by the group, in its first role's place; other roles as they are."""
    group_of = {role: name for name, roles in groups.items() for role in roles}
    out: dict[str, RankLinear] = {}
    for role, linear in linears.items():
        name = group_of.get(role, role)
        if name in out:
            out[name] = out[name]._replace(out_features=out[name].out_features + linear.out_features)
        else:
            out[name] = linear
    return out
