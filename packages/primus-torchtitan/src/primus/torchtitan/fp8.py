"""FP8 linears in torchtitan's model (``kernels.fp8``): the block linears swapped for the selected FP8
provider's (primus-turbo's ``Float8Linear`` or torchao's), before TP / FSDP / AC / compile are applied.

Swapped: ``layers.<i>.attention.{wq,wk,wv,wo}`` (latent attention's ``wq_a``, ``wq_b``, ``wkv_a``, ``wkv_b``,
``wo``; under TP its down projections ``wq_a`` / ``wkv_a`` stay bf16), ``layers.<i>.feed_forward.{w1,w2,w3}`` and a
mixture-of-experts block's shared experts ``layers.<i>.moe.shared_experts.{w1,w2,w3}`` of blocks outside the
recipe's first/last ``bf16_*_layers``; the output head only with ``bf16_output_head: false``. The routed experts of
those blocks (``layers.<i>.moe.experts``) run on the provider's FP8 grouped GEMM (``grouped_gemm_for``,
:mod:`primus.turbo.fp8.grouped`); the routers stay in bf16.
Under FSDP primus-turbo's linear gets its parameters all-gathered in bf16 as usual and casts them to fp8 inside
each GEMM; torchao's tensorwise linear has FSDP2 all-gather them in e4m3 (:func:`fsdp_fp8_all_gather`).
Under tensor parallelism primus-turbo's linear runs its GEMMs on the DTensor shards
(``primus.turbo.fp8.linear.fp8_linear_tp``); torchao's is refused there (:func:`issues`).

This module imports torch only inside the functions that swap (``issues`` runs in config validation).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from primus.core.contracts.protocols import ConfigIssue
from primus.core.kernels import linears
from primus.core.kernels.fp8_recipe import config_issues, fp8_blocks, fp8_linear_rule, fp8_linears_note, gemm_tokens
from primus.core.kernels.linears import RankLinear
from primus.core.kernels.selection import fp8_experts as fp8_experts_rule

log = logging.getLogger("primus.torchtitan")

BLOCK_LINEAR = re.compile(
    r"^layers\.(\d+)\.(attention\.(wq|wk|wv|wo|wq_a|wq_b|wkv_a|wkv_b)|feed_forward\.(w1|w2|w3)"
    r"|moe\.shared_experts\.(w1|w2|w3))$"
)
EXPERTS = re.compile(r"^layers\.(\d+)\.moe\.experts$")
OUTPUT_HEAD = "output"


def keeps_bf16(name: str, *, num_layers: int, recipe: Any) -> bool:
    """Whether the linear ``name`` (a torchtitan model FQN) stays in bf16 under ``recipe`` (Fp8Recipe
    config section: bf16_first_layers / bf16_last_layers / bf16_output_head)."""
    if name == OUTPUT_HEAD:
        return recipe.bf16_output_head
    match = BLOCK_LINEAR.match(name) or EXPERTS.match(name)
    if match is None:
        return True  # not a block linear or the routed experts (e.g. an MoE router): left alone
    block = int(match.group(1))
    return block not in fp8_blocks(num_layers, recipe.bf16_first_layers, recipe.bf16_last_layers)


# core's linear roles (primus.core.kernels.linears) by torchtitan's names: its attention (latent attention's too),
# a feed-forward's and the shared experts' (one feed-forward of their summed width)
NAMES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "q_a": "wq_a", "q_b": "wq_b", "kv_a": "wkv_a", "kv_b": "wkv_b",
         "gate": "w1", "up": "w3", "down": "w2"}  # fmt: skip


def rank_linears(model: Any, tp: int) -> dict[str, RankLinear]:
    """A block linear's name within the block (``attention.wq``, ``feed_forward.w1``, ``moe.shared_experts.w2``) and
    the output head's (``output``) -> one tensor-parallel rank's shape, core's (torchtitan's TP plan splits them
    alike: latent attention's down projections it leaves whole)."""
    parts = {
        "attention": linears.attention_linears(model, tp),
        "feed_forward": linears.mlp_linears(model, model.ffn_hidden_size, tp),
        "moe.shared_experts": linears.mlp_linears(model, linears.shared_expert_width(model), tp),
    }
    out = {f"{part}.{NAMES[role]}": linear for part, roles in parts.items() for role, linear in roles.items()}
    return out | {OUTPUT_HEAD: linears.head_linear(model, tp)}


def skip_rule(cfg: Any, too_small: list[str] | None = None) -> Callable[[str, Any], bool]:
    """``(name, module) -> bool``: the linear stays bf16, by the recipe's blocks and output head
    (:func:`keeps_bf16`), or, a linear outside the routed experts, by core's measured shape rule
    (``fp8_recipe.linears``, on one rank's share under TP (:func:`rank_linears`), at a micro-batch's tokens); under
    TP a linear the plan keeps whole stays bf16 too (the FP8 linear's TP path takes sharded weights only). The names
    the shape rule keeps go to ``too_small``. A module whose shape is not core's raises: the rule would weigh the
    wrong GEMM."""
    kernels, num_layers = cfg.kernels, cfg.model.num_layers
    pays = fp8_linear_rule(kernels, compiled=cfg.train.compile, tokens=gemm_tokens(cfg))
    tp = cfg.parallel.tp
    rank, whole = rank_linears(cfg.model, tp), rank_linears(cfg.model, 1)

    def skip(name: str, module: Any) -> bool:
        if keeps_bf16(name, num_layers=num_layers, recipe=kernels.fp8_recipe):
            return True
        if EXPERTS.match(name):  # core's fp8_experts rule decides them
            return False
        key = name if name == OUTPUT_HEAD else name.split(".", 2)[2]
        if (module.in_features, module.out_features) != whole[key].shape:
            raise RuntimeError(
                f"FP8 shape rule: {name} is {module.in_features} x {module.out_features}, core's shape table "
                f"(primus.core.kernels.linears) says {whole[key].in_features} x {whole[key].out_features}"
            )
        linear = rank[key]
        if tp > 1 and linear.split == "whole":
            return True
        if pays(*linear.shape):
            return False
        if too_small is not None:
            too_small.append(name)
        return True

    return skip


def fsdp_fp8_all_gather(cfg: Any, provider: Any, world_size: int) -> bool:
    """Whether FSDP2 all-gathers this run's FP8 weights in FP8: torchao's tensorwise linear wraps its weights in a
    tensor subclass that FSDP2 gathers in e4m3 (torchtitan's own float8 converter does the same under FSDP);
    primus-turbo's linear quantizes the gathered bf16 weight inside its GEMM."""
    sharded = cfg.parallel.shard_size(world_size) * cfg.parallel.cp > 1
    return sharded and provider.name == "torchao" and cfg.kernels.fp8 == "tensorwise"


def fp8_swap(cfg: Any, provider: Any, experts: bool) -> Callable[[Any], list[str]]:
    """``model -> names swapped``: the provider's ``convert_to_fp8`` with this run's recipe and skip rule;
    ``experts``: the routed experts of the FP8 blocks onto its FP8 grouped GEMM too (core's ``fp8_experts``)."""
    from dataclasses import replace

    import torch.distributed as dist

    from primus.core.kernels.fp8_recipe import Fp8Recipe

    config_recipe = Fp8Recipe.from_config(cfg.kernels)
    convert = provider.load()

    def swap(model: Any) -> list[str]:
        # at model build, where the process group (and so the FSDP degree) is known
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        recipe = replace(config_recipe, fp8_all_gather=fsdp_fp8_all_gather(cfg, provider, world))
        too_small: list[str] = []
        skip = skip_rule(cfg, too_small)
        names = convert(model, recipe, skip)
        on = experts and cfg.model.moe is not None
        experts_swapped = fp8_experts(model, convert.grouped_gemm_for(recipe), skip) if on else []
        gather = "fp8" if recipe.fp8_all_gather else "bf16"
        note = fp8_linears_note(len(too_small), len(too_small) + len(names)) if too_small else ""
        if note and not names and not experts_swapped:
            log.warning("kernels.fp8=%s: no linear of this run is in FP8, it trains in bf16 (%s)", recipe.mode, note)
        else:
            log.info(
                "fp8 (%s, %s): %d linears swapped, %d layers' routed experts on FP8 grouped GEMMs; FSDP all-gather %s%s",
                provider.name, recipe.mode, len(names), len(experts_swapped), gather, f"; {note}" if note else "",
            )  # fmt: skip
        return names + experts_swapped

    return swap


def fp8_experts(model: Any, gemm: Callable[..., Any], skip: Callable[[str, Any], bool]) -> list[str]:
    """The routed experts of the FP8 blocks onto the FP8 grouped GEMM ``gemm`` (whatever ran them before: torchtitan's
    own or the grouped_gemm provider; the parameters are the same). Returns their names."""
    from primus.torchtitan.kernels import use_grouped_gemm

    names = [name for name, module in model.named_modules() if EXPERTS.match(name) and not skip(name, module)]
    for name in names:
        use_grouped_gemm(model.get_submodule(name), gemm)
    return names


def choice(cfg: Any, provider: Any) -> Any:
    """The ``fp8`` entry of the run's kernel plan (:class:`primus.torchtitan.kernels.Choice`). Both providers
    run under ``train.compile``: on the H200 with torch 2.11, primus-turbo's compiled FP8 linear has eager's
    gradients (``benchmarks/fp8_compile_check.py``, the gate to run on a new torch or GPU)."""
    from primus.core.contracts.errors import UserError
    from primus.torchtitan.kernels import Choice

    if provider.name == "torchao" and cfg.parallel.tp > 1:  # `auto` fell to torchao (primus-turbo's unavailable)
        raise UserError(
            "kernels.fp8: torchao's FP8 linears cannot run under parallel.tp > 1 in this backend, and "
            "primus-turbo's FP8 linear is not available here; use parallel.tp: 1 or kernels.fp8: off"
        )
    r = cfg.kernels.fp8_recipe
    note = (
        f"{cfg.kernels.fp8}, grads {r.grad_dtype}, {r.scaling} scaling; bf16 first {r.bf16_first_layers} / last "
        f"{r.bf16_last_layers} blocks{', output head bf16' if r.bf16_output_head else ''}"
    )
    experts = False
    if cfg.model.moe is not None:
        experts, why = fp8_experts_rule(cfg.kernels, provider)
        note += f"; {why}"
    return Choice("fp8", provider.name, fp8_swap(cfg, provider, experts), note)


def issues(cfg: Any) -> list[ConfigIssue]:
    """What the torchtitan backend refuses for ``kernels.fp8`` (empty when off)."""
    if cfg.kernels.fp8 == "off":
        return []
    out = config_issues(cfg, engine="torchtitan")
    if cfg.parallel.tp > 1 and cfg.kernels.fp8_recipe.implementation == "torchao":
        out.append(
            ConfigIssue(
                "kernels.fp8_recipe.implementation",
                "torchao's FP8 linears under tensor parallelism need torchao's own Float8 parallel styles, which "
                "this backend does not apply; primus-turbo's FP8 linear runs on the DTensor shards",
                value="torchao",
                allowed="primus or auto (with parallel.tp > 1)",
            )
        )
    return out
