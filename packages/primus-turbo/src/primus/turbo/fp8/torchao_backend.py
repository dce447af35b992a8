"""The FP8 swap through ``torchao.float8`` (torchao 0.1x API), for ``fp8_recipe.implementation`` torchao
(asked for by name: ``auto`` prefers primus-turbo's linear): ``convert_to_float8_training(module,
module_filter_fn=..., config=Float8LinearConfig)``, the filter called as ``(module, fqn)``.

What torchao's float8 training does not offer is refused here with the reason (:func:`unsupported`):
delayed scaling (torchao keeps only dynamic scaling), and rowwise with e5m2 gradients (its rowwise recipe
casts gradients to e4m3). Under FSDP2 the tensorwise weights are all-gathered in e4m3
(``enable_fsdp_float8_all_gather``; not run: one GPU here, and torchao is not installed on the CPU machines).
torchtitan's per-step ``precompute_float8_dynamic_scale_for_fsdp`` (one amax pass for all weights) is not wired:
each weight computes its own scale before its all-gather.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from primus.turbo.fp8.recipe import Fp8Recipe


def unsupported(recipe: Fp8Recipe) -> str:
    """Why torchao's float8 training cannot run ``recipe`` ("" when it can)."""
    if recipe.scaling == "delayed":
        return "torchao.float8 has only dynamic (current) scaling"
    if recipe.mode == "rowwise" and recipe.grad_dtype != "e4m3":
        return "torchao.float8's rowwise recipe casts gradients to e4m3 (set fp8_recipe.grad_dtype: e4m3)"
    return ""


def float8_config(recipe: Fp8Recipe):
    import dataclasses

    import torch
    from torchao.float8 import CastConfig, Float8GemmConfig, Float8LinearConfig

    if why := unsupported(recipe):
        raise ValueError(f"kernels.fp8_recipe: {why}")
    backward = {}
    if recipe.fast_accum_backward:  # torchao 0.18's per-GEMM configs; this path was not run on the GPU
        fast = Float8GemmConfig(use_fast_accum=True)
        backward = {"gemm_config_grad_input": fast, "gemm_config_grad_weight": fast}
    if recipe.mode == "rowwise":
        return dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), **backward)
    grad = torch.float8_e5m2 if recipe.grad_dtype == "e5m2" else torch.float8_e4m3fn
    # FSDP2 all-gathers the weights in e4m3 (torchao's tensorwise only; the engine sets fp8_all_gather under FSDP)
    gather = {"enable_fsdp_float8_all_gather": True} if recipe.fp8_all_gather else {}
    return Float8LinearConfig(cast_config_grad_output=CastConfig(target_dtype=grad), **backward, **gather)


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe, skip: Callable[[str, nn.Module], bool] | None = None):
    """Swap ``model``'s linears for torchao's Float8Linear (except where ``skip(name, module)``); returns
    the names swapped."""
    from torchao.float8 import convert_to_float8_training

    before = {name for name, m in model.named_modules() if type(m) is nn.Linear}
    convert_to_float8_training(
        model,
        module_filter_fn=lambda module, fqn: not (skip and skip(fqn, module)),
        config=float8_config(recipe),
    )
    return sorted(before - {name for name, m in model.named_modules() if type(m) is nn.Linear})
