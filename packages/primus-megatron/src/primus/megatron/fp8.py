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
from typing import Any

from primus.core.contracts.protocols import ConfigIssue
from primus.core.kernels.fp8_recipe import (
    FP8_RULE_TOKENS,
    config_issues,
    fp8_blocks,
    fp8_linear_rule,
    fp8_linears_note,
)

log = logging.getLogger("primus.megatron")


# why FP8 experts must be StackedExperts (megatron's SequentialMLP keeps one linear pair per expert)
FP8_EXPERTS_NEED = "FP8 experts run as the FP8 provider's grouped GEMM over stacked expert weights"


def fp8_layer_numbers(kernels: Any, num_layers: int) -> set[int]:
    """0-based global block indices whose linears run in FP8 under the recipe."""
    r = kernels.fp8_recipe
    return set(fp8_blocks(num_layers, r.bf16_first_layers, r.bf16_last_layers))


def chunk_fp8_flags(
    config: Any, kernels: Any, *, vp_stage: int | None, n: int, mla: Any = None, tokens: int = FP8_RULE_TOKENS
) -> list[bool]:
    """Per block of this model chunk (n blocks, pipeline offset from megatron): FP8 linears or not; ``mla``: core's
    ModelConfig of a latent-attention model (its attention linears in the kernel log); ``tokens``: a micro-batch's
    on one rank (:func:`primus.core.kernels.fp8_recipe.gemm_tokens`)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    in_fp8 = fp8_layer_numbers(kernels, config.num_layers)
    flags = [offset + i in in_fp8 for i in range(n)]
    blocks = [offset + i for i, on in enumerate(flags) if on]
    shapes = linear_shapes(config, mla=mla)
    freq = config.moe_layer_freq  # megatron's: 1 (every block), or a list of 0 / 1 per block
    if config.num_moe_experts and (all(freq) if isinstance(freq, list) else freq == 1):  # no dense fc1 / fc2
        shapes = {k: v for k, v in shapes.items() if k not in ("linear_fc1", "linear_fc2")}
    if config.moe_shared_expert_intermediate_size:
        shapes |= {f"shared {k}": v for k, v in linear_shapes(config, shared=True).items()}
    pays = fp8_linear_rule(kernels, compiled=False, tokens=tokens)
    kept = [name for name, shape in shapes.items() if not pays(*shape)]
    note = f"{', '.join(kept)}: {fp8_linears_note(len(kept), len(shapes))}" if kept else ""
    if blocks and len(kept) == len(shapes) and not (config.num_moe_experts and kernels.fp8_recipe.experts == "fp8"):
        log.warning("kernels.fp8=%s: no linear of this model's blocks is in FP8 (%s)", kernels.fp8, note)
    else:
        blocks_note = f"FP8 linears in blocks {blocks} of {offset}-{offset + n - 1}" + (f"; {note}" if note else "")
        log.info("fp8 (%s): %s", kernels.fp8, blocks_note)
    return flags


def linear_shapes(config: Any, *, shared: bool = False, mla: Any = None) -> dict[str, tuple[int, int]]:
    """One rank's (in_features, out_features) of a block's linears, from megatron's TransformerConfig: qkv and fc1
    column-parallel (a slice of the outputs), proj and fc2 row-parallel (a slice of the inputs); ``shared``: the
    shared experts' fc1 / fc2; ``mla`` (core's ModelConfig of a latent-attention model): its attention linears
    (:func:`mla_linear_shapes`) for qkv and proj."""
    tp = config.tensor_model_parallel_size
    h = config.hidden_size
    ffn = config.moe_shared_expert_intermediate_size if shared else config.ffn_hidden_size
    shapes = {"linear_fc1": (h, ffn * (2 if config.gated_linear_unit else 1) // tp), "linear_fc2": (ffn // tp, h)}
    if not shared and mla is not None:
        shapes |= mla_linear_shapes(mla, tp)
    elif not shared:
        q = config.num_attention_heads * config.kv_channels
        kv = 2 * (config.num_query_groups or config.num_attention_heads) * config.kv_channels
        shapes |= {"linear_qkv": (h, (q + kv) // tp), "linear_proj": (q // tp, h)}
    return shapes


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
        **_: Any,
    ) -> Any:
        if allreduce_dgrad or grad_output_buffer is not None:
            raise RuntimeError(
                "FP8 linear: in-GEMM dgrad all-reduce / deferred wgrad are megatron's autograd-function features the "
                "FP8 linear does not implement"
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


def linear_specs(
    kernels: Any,
    provider: Any,
    config: Any,
    *,
    shared: bool = False,
    mla: Any = None,
    tokens: int = FP8_RULE_TOKENS,
) -> dict[str, Any]:
    """The spec entries for one FP8 block: its linears (:func:`linear_shapes`: linear_qkv / linear_fc1 column,
    linear_proj / linear_fc2 row; ``shared``: the shared experts' fc1 / fc2; ``mla``: latent attention's in place of
    qkv / proj) that ``fp8_recipe.linears`` puts in FP8 at this model's shapes; ``kernels`` the config's section,
    ``provider`` the run's ``fp8`` kernel choice."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from primus.core.kernels.fp8_recipe import Fp8Recipe

    recipe = Fp8Recipe.from_config(kernels)
    column, row = linear_classes(provider)
    col_spec = ModuleSpec(module=column, params={"fp8_recipe": recipe})
    row_spec = ModuleSpec(module=row, params={"fp8_recipe": recipe})
    pays = fp8_linear_rule(kernels, compiled=False, tokens=tokens)  # megatron-core's model runs eager here
    return {
        name: row_spec if name in ROW_PARALLEL else col_spec
        for name, shape in linear_shapes(config, shared=shared, mla=mla).items()
        if pays(*shape)
    }


ROW_PARALLEL = ("linear_proj", "linear_fc2")  # the others, latent attention's too, are column-parallel

# core's latent-attention roles (primus.core.config.deepseek.attention_linears) -> megatron's MLASelfAttention
# submodule
MLA_LINEARS = {
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


def mla_linear_shapes(model: Any, tp: int = 1) -> dict[str, tuple[int, int]]:
    """megatron's MLA linears of ``model`` (core's ModelConfig) that may run in FP8 (not :data:`BF16_ONLY`) -> one
    tensor-parallel rank's (in_features, out_features) (core's rank_attention_linears)."""
    from primus.core.config.deepseek import rank_attention_linears

    linears = {MLA_LINEARS[role]: shape for role, shape in rank_attention_linears(model, tp).items()}
    return {name: shape for name, shape in linears.items() if name not in BF16_ONLY}


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
