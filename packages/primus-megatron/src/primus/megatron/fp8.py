"""FP8 linears in megatron-core's local layer spec (``kernels.fp8``, primus-turbo's FP8 linear).

megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` run their GEMM through ``_forward_impl``
(``linear_with_grad_accumulation_and_async_allreduce``); the subclasses here override only that method
with :func:`primus.turbo.fp8.fp8_linear`, so the tensor-parallel communication stays megatron's:

- Column: the input goes through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of
  dgrad backward) instead of the async all-reduce overlapped inside megatron's autograd function: the
  subclass sets ``allreduce_dgrad = False`` (what megatron itself does for explicit expert comm), so the
  dgrad all-reduce is synchronous but correct.
- Row: the local GEMM, then megatron's all-reduce of the output as before (with sequence parallelism:
  megatron's reduce-scatter of the output, outside ``_forward_impl``).
- Column under sequence parallelism: megatron hands ``_forward_impl`` the sequence-sharded input and does the
  all-gather / dgrad reduce-scatter inside its autograd GEMM function; here megatron's own
  ``gather_from_sequence_parallel_region`` (all-gather forward, reduce-scatter backward) runs before the FP8 GEMM,
  synchronously, where megatron overlaps them. The FP8 linear keeps the gathered input for its backward, in e4m3
  (1 byte × the whole sequence); megatron keeps its shard in bf16 (2 bytes × 1/tp of it) and gathers again in
  the backward, so beyond tp = 2 this holds more activation memory than megatron's own linear.

Refused (:func:`issues`): ``fp8_recipe.implementation: torchao`` (torchao swaps
``nn.Linear``; these are megatron modules). Delayed-scaling histories are plain tensors on the module,
never in its state dict. The recipe's first/last bf16 blocks are counted in global layer numbers
(pipeline stages and virtual stages included); the output head is megatron's vocab-parallel linear and
stays bf16 (``bf16_output_head: false`` is refused). Within an FP8 block, ``fp8_recipe.linears: auto`` (core's
:func:`~primus.core.kernels.fp8_recipe.fp8_linear_rule`, eager: megatron-core's model is not compiled here) keeps in
bf16 each linear whose per-rank weight is too small for FP8 to be faster (:func:`linear_shapes`).

Mixture-of-experts blocks in FP8 (:func:`primus.megatron.layer_spec.moe_spec`): the routed experts
(:class:`~primus.megatron.experts.StackedExperts`) run on the provider's FP8 grouped GEMM (``grouped_gemm_for``), the
shared experts' linears are these FP8 linears, the router stays bf16. Megatron's per-expert SequentialMLP
(``kernels.grouped_gemm: torch``) is refused with FP8.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from primus.core.contracts.protocols import ConfigIssue, KernelProvider
from primus.core.kernels import linears
from primus.core.kernels.fp8_recipe import config_issues, fp8_blocks, fp8_linear_rule, fp8_linears_note, gemm_tokens
from primus.megatron.planner_profile import GEMM_GROUPS

if TYPE_CHECKING:
    from primus.core.config.schema import ModelConfig, PrimusConfig

log = logging.getLogger("primus.megatron")


# why FP8 experts must be StackedExperts (megatron's SequentialMLP keeps one linear pair per expert)
FP8_EXPERTS_NEED = "FP8 experts run as the FP8 provider's grouped GEMM over stacked expert weights"


@dataclass(frozen=True)
class Fp8Linears:
    """A run's FP8 linears in megatron's block specs, decided once from its config (:func:`plan`): the blocks in FP8
    (global numbers, the recipe's ``bf16_*_layers`` left out) and in each the linears ``fp8_recipe.linears`` puts in
    FP8 at one rank's shapes (:func:`linear_shapes`), by megatron's submodule name."""

    kernels: Any  # the config's kernels section (its recipe)
    provider: KernelProvider  # the run's ``fp8`` kernel choice
    blocks: frozenset[int]
    linears: Mapping[str, str]  # attention's and the dense MLP's in FP8: name -> TP split ("column" / "row")
    shared_linears: Mapping[str, str]  # the shared experts' linear_fc1 / linear_fc2 in FP8, the same
    note: str  # the linears left in bf16, and why ("" where none)
    linear_free: bool  # no dense linear of any block is in FP8 (only routed experts may be)


def plan(cfg: PrimusConfig, kernels: dict[str, KernelProvider]) -> Fp8Linears | None:
    """The run's :class:`Fp8Linears` (None with ``kernels.fp8: off``) on its ``fp8`` kernel choice (of ``kernels``).
    Megatron-core's model runs eager here: core's eager shape rule at a micro-batch's tokens on one rank."""
    k, m, tp = cfg.kernels, cfg.model, cfg.parallel.tp
    if k.fp8 == "off":
        return None
    pays = fp8_linear_rule(k, compiled=False, tokens=gemm_tokens(cfg))
    block, shared = linear_shapes(m, tp), linear_shapes(m, tp, shared=True)
    # the linears a block of this model holds, for the note: no dense MLP where every block is MoE
    every_moe = m.moe is not None and all(map(m.moe.is_moe_layer, range(m.num_layers)))
    held = {n: s for n, s in block.items() if n not in DENSE_MLP or not every_moe}
    held |= {f"shared {n}": s for n, s in shared.items()}
    kept = [name for name, linear in held.items() if not pays(*linear.shape)]
    r = k.fp8_recipe
    return Fp8Linears(
        k,
        kernels["fp8"],
        frozenset(fp8_blocks(m.num_layers, r.bf16_first_layers, r.bf16_last_layers)),
        MappingProxyType({n: linear.split for n, linear in block.items() if pays(*linear.shape)}),
        MappingProxyType({n: linear.split for n, linear in shared.items() if pays(*linear.shape)}),
        f"{', '.join(kept)}: {fp8_linears_note(len(kept), len(held))}" if kept else "",
        len(kept) == len(held),
    )


def chunk_fp8_flags(config: Any, fp8: Fp8Linears, *, vp_stage: int | None, n: int) -> list[bool]:
    """Per block of this model chunk (n blocks, pipeline offset from megatron): FP8 linears or not."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    flags = [offset + i in fp8.blocks for i in range(n)]
    blocks = [offset + i for i, on in enumerate(flags) if on]
    mode = fp8.kernels.fp8
    if blocks and fp8.linear_free and not (config.num_moe_experts and fp8.kernels.fp8_recipe.experts == "fp8"):
        log.warning("kernels.fp8=%s: no linear of this model's blocks is in FP8 (%s)", mode, fp8.note)
    else:
        blocks_note = f"FP8 linears in blocks {blocks} of {offset}-{offset + n - 1}" + (
            f"; {fp8.note}" if fp8.note else ""
        )
        log.info("fp8 (%s): %s", mode, blocks_note)
    return flags


DENSE_MLP = ("linear_fc1", "linear_fc2")
# core's linear roles (primus.core.kernels.linears) -> megatron's submodule names; linear_qkv and linear_fc1 are
# GEMM groups (planner_profile.GEMM_GROUPS); latent attention's roles -> MLASelfAttention's submodules
NAMES = {
    "linear_qkv": "linear_qkv",
    "linear_fc1": "linear_fc1",
    "down": "linear_fc2",
    "q": "linear_q_proj",
    "q_a": "linear_q_down_proj",
    "q_b": "linear_q_up_proj",
    "kv_a": "linear_kv_down_proj",
    "kv_b": "linear_kv_up_proj",
    "o": "linear_proj",
}
# megatron-core 0.16's MLASelfAttention accepts only its own classes (by identity) for the down projections: they
# stay bf16 (at DeepSeek-V3's shapes, 7168 x 1536 and 7168 x 576, core's eager rule keeps them bf16 anyway)
BF16_ONLY = ("linear_q_down_proj", "linear_kv_down_proj")


def linear_shapes(model: ModelConfig, tp: int, *, shared: bool = False) -> dict[str, linears.RankLinear]:
    """One tensor-parallel rank's shape and split of a block's linears that may run in FP8, by megatron's submodule
    name: core's table (:mod:`primus.core.kernels.linears`) with megatron's GEMM groups (qkv and fc1 column-parallel,
    proj and fc2 row-parallel; latent attention's linears but :data:`BF16_ONLY`); ``shared``: the shared experts'
    fc1 / fc2."""
    if shared:
        roles = linears.mlp_linears(model, linears.shared_expert_width(model), tp)
    else:
        roles = linears.attention_linears(model, tp) | linears.mlp_linears(model, model.ffn_hidden_size, tp)
    named = {NAMES[name]: linear for name, linear in linears.fused(roles, GEMM_GROUPS).items()}
    return {name: linear for name, linear in named.items() if name not in BF16_ONLY}


def linear_classes(provider: Any) -> tuple[type, type]:
    """(Fp8ColumnParallelLinear, Fp8RowParallelLinear) on ``provider``'s FP8 GEMM (the ``fp8`` kernel choice:
    its impl carries ``fp8_linear`` and ``Fp8State``), built on first use (imports megatron and torch)."""
    if provider.name not in _CLASSES:
        _CLASSES[provider.name] = _build_classes(provider)
    return _CLASSES[provider.name]


_CLASSES: dict[str, tuple[type, type]] = {}


def _build_classes(provider: Any) -> tuple[type, type]:
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    impl = provider.load()
    if not hasattr(impl, "fp8_linear"):
        raise RuntimeError(
            f"FP8 provider {provider.name!r} swaps torch.nn.Linear modules only; megatron's tensor-parallel linears "
            "need one that offers fp8_linear (set kernels.fp8_recipe.implementation=primus)"
        )
    Fp8State, fp8_linear = impl.Fp8State, impl.fp8_linear  # noqa: N806 (a class)
    for_device = getattr(impl, "for_device", lambda recipe: recipe)  # the device's FP8 formats (fnuz on MI300)

    def setup(self: Any, fp8_recipe: Any) -> None:
        self.fp8_recipe = for_device(fp8_recipe)
        self.fp8_state = Fp8State(fp8_recipe.amax_history)

    def forward_impl(
        self: Any,
        input: Any,
        weight: Any,
        bias: Any = None,
        gradient_accumulation_fusion: bool = False,
        allreduce_dgrad: bool = False,
        sequence_parallel: bool = False,
        grad_output_buffer: Any = None,
        wgrad_deferral_limit: Any = None,
        tp_group: Any = None,
        gtp_remat_size: int = 1,  # megatron-core 0.19: >1 when the weight is GTP-sharded (gathered in its GEMM)
        **_: Any,
    ) -> Any:
        if allreduce_dgrad or grad_output_buffer is not None or gtp_remat_size > 1:
            raise RuntimeError(
                "FP8 linear: in-GEMM dgrad all-reduce / deferred wgrad / GTP-sharded weights are megatron's "
                "autograd-function features the FP8 linear does not implement"
            )
        if sequence_parallel:  # [s/tp, b, h] -> [s, b, h]; the input's gradient is reduce-scattered back
            input = tensor_parallel.gather_from_sequence_parallel_region(input, True, group=tp_group)
        return fp8_linear(input, weight, bias, recipe=self.fp8_recipe, state=self.fp8_state)

    class Fp8ColumnParallelLinear(ColumnParallelLinear):
        """megatron's ColumnParallelLinear (same parameters and state dict) with FP8 GEMMs."""

        def __init__(self, *args: Any, fp8_recipe: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            setup(self, fp8_recipe)
            self.allreduce_dgrad = False  # the input's copy_to_tensor_model_parallel_region all-reduces dgrad

        _forward_impl = forward_impl

    class Fp8RowParallelLinear(RowParallelLinear):
        """megatron's RowParallelLinear (same parameters and state dict) with FP8 GEMMs."""

        def __init__(self, *args: Any, fp8_recipe: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            setup(self, fp8_recipe)

        _forward_impl = forward_impl

    return Fp8ColumnParallelLinear, Fp8RowParallelLinear


def linear_specs(fp8: Fp8Linears, *, shared: bool = False) -> dict[str, Any]:
    """The spec entries for one FP8 block's linears in FP8 (:class:`Fp8Linears`: a block's attention and dense MLP
    ones; ``shared``: the shared experts' fc1 / fc2), on the run's FP8 provider under the config's recipe."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from primus.core.kernels.fp8_recipe import Fp8Recipe

    recipe = Fp8Recipe.from_config(fp8.kernels)
    column, row = linear_classes(fp8.provider)
    col_spec = ModuleSpec(module=column, params={"fp8_recipe": recipe})
    row_spec = ModuleSpec(module=row, params={"fp8_recipe": recipe})
    chosen = fp8.shared_linears if shared else fp8.linears
    return {name: row_spec if split == "row" else col_spec for name, split in chosen.items()}


def issues(cfg: Any) -> list[ConfigIssue]:
    """What the megatron backend refuses for ``kernels.fp8`` (empty when off)."""
    k = cfg.kernels
    if k.fp8 == "off":
        return []
    out = config_issues(cfg, engine="megatron")
    if k.fp8_recipe.implementation == "torchao":
        out.append(
            ConfigIssue(
                "kernels.fp8_recipe.implementation",
                "torchao swaps torch.nn.Linear; megatron's tensor-parallel linears are not, so the megatron backend "
                "uses primus-turbo's FP8 linear",
                value="torchao",
                allowed="auto, primus",
            )
        )
    if not k.fp8_recipe.bf16_output_head:
        out.append(
            ConfigIssue(
                "kernels.fp8_recipe.bf16_output_head",
                "the megatron backend keeps the output head (a vocab-parallel linear feeding the fused "
                "cross-entropy) in bf16",
                value=False,
                allowed="true",
            )
        )
    return out
