"""The transformer layer spec: megatron-core's local building blocks (tensor-parallel linears,
SelfAttention, MLP, bias-dropout-add), with the modules Primus selects kernels for swapped in.

- core attention calls the ``attention`` provider (megatron's local ``DotProductAttention`` is
  unfused: it materialises [b, h, s, s] scores and runs out of memory at long sequences);
- every RMSNorm (input, pre-MLP, q/k-norm, final) calls the ``rms_norm`` provider;
- the SwiGLU activation calls the ``swiglu`` provider through the MLP's activation slot.

- RoPE calls the ``rope`` provider (a non-reference one) through :class:`primus.megatron.rope.KernelRoPESelfAttention`
  (RoPE is not a slot of the spec: it is applied inside SelfAttention.forward).

The output layer + loss are the model's, not the layer's: :mod:`primus.megatron.gpt` fuses them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from primus.core.contracts.protocols import KernelProvider, load_ref
from primus.core.kernels import reference
from primus.core.kernels.selection import fp8_experts
from primus.megatron import compat
from primus.megatron.fp8 import Fp8Linears
from primus.megatron.rope import KernelRoPESelfAttention, rope_impl


class KernelCoreAttention(MegatronModule):
    """Core attention through a Primus attention provider.

    megatron hands over q [s, b, h/tp, d] and k, v [s, b, h_kv/tp, d] and wants [s, b, h/tp · d];
    the provider contract is q [b, h, s, d], k/v [b, h_kv, s, d] (causal, GQA without repeating K/V).
    Under context parallelism ``s`` is this rank's two chunks of the sequence, and the provider's
    ``context_parallel`` entry point takes the context-parallel group.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        k_channels: int | None = None,  # multi-head latent attention's q/k and v head dims (the tensors carry them)
        v_channels: int | None = None,
        *,
        kernel: Any = "",
    ):
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("attention dropout is not supported by the kernel attention providers")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"only causal attention is supported, got {attn_mask_type}")
        self.attn = load_ref(kernel)
        self.softmax_scale = softmax_scale
        self.cp_group = None
        if config.context_parallel_size > 1:
            # the sequence is split over the context-parallel ranks (megatron's 2 x cp chunks, see engine.py): the
            # provider's context-parallel entry point (its "context_parallel" feature) exchanges K/V between them
            self.attn = getattr(self.attn, "context_parallel", None)
            if self.attn is None:
                raise ValueError(f"attention provider {kernel} has no context-parallel entry point (cp > 1)")
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()

    def forward(
        self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("packed sequences and attention bias are not supported by KernelCoreAttention")
        s, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        kw: dict[str, Any] = {} if self.cp_group is None else {"group": self.cp_group}
        if attention_mask is not None:  # data.document_mask: [b, s] document ids (the engine's forward step)
            kw["documents"] = attention_mask
        out = self.attn(q, k, v, causal=True, scale=self.softmax_scale, **kw)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class KernelRMSNorm(torch.nn.Module):
    """RMSNorm through a Primus ``rms_norm`` provider, built the way megatron builds its norms.

    Its weight is marked ``sequence_parallel`` (when SP is on) so megatron all-reduces its gradient
    over the TP group, as it does for its own fused norms.
    """

    def __init__(
        self,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        kernel: Any = "",
        for_qk: bool = False,
        **_ignored: Any,
    ):
        super().__init__()
        self.fn = load_ref(kernel)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel and not for_qk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.eps)


class KernelSwiGLU(MegatronModule):
    """silu(gate) · up on megatron's fc1 output ([..., 2·ffn/tp]: gate half first, then up).
    A MegatronModule because the MLP asks each of its children for a sharded state dict."""

    def __init__(self, config: Any, *, kernel: Any = ""):
        super().__init__(config=config)
        self.fn = load_ref(kernel)
        # a provider's packed form takes fc1's output whole and returns its gradient in that layout: autograd's
        # chunk backward would otherwise concatenate the two halves' gradients (a copy of [tokens, 2 x ffn])
        self.packed = getattr(self.fn, "packed", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        gate, up = torch.chunk(x, 2, dim=-1)
        return self.fn(gate, up)


def _impl(kernels: dict[str, KernelProvider], op: str) -> Any:
    """The provider's impl as given ("module:attr" or a callable); the modules load it when built."""
    return kernels[op].impl


# The routed experts' activation in megatron's loop of experts (SequentialMLP, with core's reference grouped_gemm): core's
# SwiGLU (torch's kernels), whatever the swiglu provider. A loop of small MLPs is where a provider's kernel launch costs
# more than its fusion saves (the grouped experts take the swiglu provider: one launch for all): on the H200,
# a Qwen3-30B-A3B-shaped model (128 experts, 6 layers, seq 4096) trained at 5,484 tokens/s with primus-turbo's
# Triton SwiGLU in the experts and 7,343 with torch's (benchmarks/results/moe_h200_round2.json and
# moe_h200_mg_swiglu_torch.json). TorchTitan's grouped experts keep their own activation too.
EXPERT_SWIGLU = "primus.core.kernels.reference:swiglu"


def experts_impl(kernels: dict[str, KernelProvider]) -> tuple[KernelProvider | None, str]:
    """The grouped_gemm provider the routed experts run on (None: megatron's SequentialMLP), and what runs, in words."""
    gemm = kernels.get("grouped_gemm")
    if gemm is None or gemm.load() is reference.grouped_gemm:
        name = gemm.name if gemm else "none"
        return None, f"grouped_gemm provider {name!r} is core's loop: megatron's SequentialMLP computes the same"
    return (
        gemm,
        f"grouped GEMMs of provider {gemm.name!r} over all local experts' stacked weights (primus.megatron.experts)",
    )


def experts_layout(kernels: dict[str, KernelProvider]) -> str:
    """How the routed experts hold their weights with these providers (recorded in checkpoints: the optimizer state
    of one does not load into the other): stacked (StackedExperts) or per expert (SequentialMLP)."""
    from primus.megatron.experts import PER_EXPERT, STACKED

    return PER_EXPERT if experts_impl(kernels)[0] is None else STACKED


def _experts_spec(
    kernels: dict[str, KernelProvider], submodules: MLPSubmodules, fp8: Fp8Linears | None = None
) -> ModuleSpec:
    from megatron.core.transformer.moe.experts import SequentialMLP

    gemm, _ = experts_impl(kernels)
    if gemm is None:
        if fp8 is not None:  # validation refuses kernels.grouped_gemm: torch with fp8; here `auto` found no other
            from primus.megatron.fp8 import FP8_EXPERTS_NEED

            raise RuntimeError(
                f"FP8 experts: {FP8_EXPERTS_NEED}, and no grouped_gemm provider but core's loop is available"
            )
        return ModuleSpec(module=SequentialMLP, submodules=submodules)
    from primus.megatron.experts import StackedExperts

    if fp8 is not None and not fp8_experts(fp8.kernels, fp8.provider)[0]:  # core's rule: bf16 unless measured faster
        fp8 = None
    gemm_impl = gemm.impl if fp8 is None else fp8_grouped_gemm(fp8)
    params = {"gemm": gemm_impl, "swiglu": _impl(kernels, "swiglu")}
    return ModuleSpec(module=StackedExperts, submodules=submodules, params=params)


def fp8_grouped_gemm(fp8: Fp8Linears) -> Any:
    """The FP8 provider's grouped GEMM (``grouped_gemm_for``: core's selection took one with that feature for an MoE
    model) under the config's recipe."""
    from primus.core.kernels.fp8_recipe import Fp8Recipe

    return fp8.provider.load().grouped_gemm_for(Fp8Recipe.from_config(fp8.kernels))


def moe_spec(kernels: dict[str, KernelProvider], shared: bool, fp8: Fp8Linears | None = None) -> ModuleSpec:
    """megatron-core's MoE layer (router, token dispatcher) with its routed experts as grouped GEMMs
    (:class:`~primus.megatron.experts.StackedExperts`: the ``grouped_gemm`` and ``swiglu`` providers over all local
    experts' stacked weights at once) or, with core's reference loop as the ``grouped_gemm`` provider, as megatron's
    own loop of local MLPs (SequentialMLP, which computes the same) with core's SwiGLU (:data:`EXPERT_SWIGLU`).
    Shared experts (one MLP of their summed width, when the model has them) take the ``swiglu`` provider, as a
    dense MLP. ``fp8`` (the run's plan, in an FP8 block): the stacked experts on the FP8 provider's grouped GEMM, the
    shared experts' linears FP8 ones where it puts them in FP8; the router stays bf16."""
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    plain = {"linear_fc1": ColumnParallelLinear, "linear_fc2": RowParallelLinear}
    shared_linears = dict(plain)  # FP8 linears in an FP8 block, as a dense MLP's
    if fp8 is not None:
        from primus.megatron.fp8 import linear_specs

        shared_linears.update(linear_specs(fp8, shared=True) if shared else {})

    def mlp(swiglu: Any, linears: dict[str, Any]) -> MLPSubmodules:
        return MLPSubmodules(
            linear_fc1=linears["linear_fc1"],
            linear_fc2=linears["linear_fc2"],
            activation_func=ModuleSpec(module=KernelSwiGLU, params={"kernel": swiglu}),
        )

    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=_experts_spec(kernels, mlp(EXPERT_SWIGLU, plain), fp8),
            shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=mlp(_impl(kernels, "swiglu"), shared_linears))
            if shared
            else None,
        ),
    )


def layer_spec(
    kernels: dict[str, KernelProvider],
    *,
    qk_norm: bool,
    fp8: Fp8Linears | None = None,
    moe: ModuleSpec | None = None,
    mla: bool = False,
) -> ModuleSpec:
    """One block; ``fp8`` (the run's plan, in an FP8 block) makes its linears FP8 ones (those the plan puts in FP8);
    ``moe`` (a :func:`moe_spec`) replaces its dense MLP; ``mla`` (a latent-attention model) makes its attention
    megatron's MLASelfAttention."""
    lin = {
        "linear_qkv": ColumnParallelLinear,
        "linear_proj": RowParallelLinear,
        "linear_fc1": ColumnParallelLinear,
        "linear_fc2": RowParallelLinear,
    }
    fp8_linears = {}  # the block's linears in FP8 (latent attention's with mla), by megatron's submodule name
    if fp8 is not None:
        from primus.megatron.fp8 import linear_specs

        fp8_linears = linear_specs(fp8)
        lin.update(fp8_linears)
    norm = ModuleSpec(module=KernelRMSNorm, params={"kernel": _impl(kernels, "rms_norm")})
    qk = ModuleSpec(module=KernelRMSNorm, params={"kernel": _impl(kernels, "rms_norm"), "for_qk": True})
    rope, _ = rope_impl(kernels)
    attention = None
    if mla:  # multi-head latent attention (primus.megatron.deepseek)
        from primus.megatron.deepseek import attention_spec

        core = ModuleSpec(module=KernelCoreAttention, params={"kernel": _impl(kernels, "attention")})
        mlp_linears = ("linear_fc1", "linear_fc2")  # (lin's, for the MLP below)
        # its latent norms see the sequence-parallel share of the tokens, as the block's norms do: `norm`, not `qk`
        attention = attention_spec(norm, core, {k: v for k, v in fp8_linears.items() if k not in mlp_linears})
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=attention
            or ModuleSpec(
                module=KernelRoPESelfAttention if rope else SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal, **({"rope": rope} if rope else {})},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=lin["linear_qkv"],
                    core_attention=functools.partial(KernelCoreAttention, kernel=_impl(kernels, "attention")),
                    linear_proj=lin["linear_proj"],
                    q_layernorm=qk if qk_norm else IdentityOp,
                    k_layernorm=qk if qk_norm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=moe
            or compat.dense_mlp(
                MLPSubmodules(
                    linear_fc1=lin["linear_fc1"],
                    linear_fc2=lin["linear_fc2"],
                    activation_func=ModuleSpec(module=KernelSwiGLU, params={"kernel": _impl(kernels, "swiglu")}),
                )
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(
    config: Any,
    kernels: dict[str, KernelProvider],
    *,
    qk_norm: bool,
    vp_stage: int | None,
    fp8: Fp8Linears | None = None,
    mla: bool = False,
) -> TransformerBlockSubmodules:
    """The layers of one model chunk plus the final norm (which must also be the kernel norm:
    megatron's default final norm is TE, apex or torch's, the last refusing sequence parallel); ``fp8``: the run's
    FP8 plan (:func:`primus.megatron.fp8.plan`), ``mla``: latent attention."""
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=_layer_specs(config, kernels, qk_norm=qk_norm, vp_stage=vp_stage, n=n, fp8=fp8, mla=mla),
        layer_norm=ModuleSpec(module=KernelRMSNorm, params={"kernel": _impl(kernels, "rms_norm")}),
    )


def mtp_block_spec(config: Any, block: TransformerBlockSubmodules, kernels: dict[str, KernelProvider],
                   vp_stage: int | None) -> Any:  # fmt: skip
    """Multi-token prediction's depths (``config.mtp_num_layers``) on the chunk that holds them (megatron: the last
    pipeline stage), None elsewhere: megatron's MultiTokenPredictionLayer with this model's last block, the kernel
    norms (both inputs' and the output's) and a column-parallel ``eh_proj``, as megatron's local spec builds it."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        get_mtp_num_layers_to_build,
    )

    if not config.mtp_num_layers or get_mtp_num_layers_to_build(config, vp_stage=vp_stage) == 0:
        return None
    norm = ModuleSpec(module=KernelRMSNorm, params={"kernel": _impl(kernels, "rms_norm")})
    depth = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=compat.mtp_layer_submodules(
            block.layer_specs[-1], enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, layer_norm=norm,
        ),
    )  # fmt: skip
    return MultiTokenPredictionBlockSubmodules(layer_specs=[depth] * config.mtp_num_layers)


def _layer_specs(
    config: Any,
    kernels: dict[str, KernelProvider],
    *,
    qk_norm: bool,
    vp_stage: Any,
    n: int,
    fp8: Fp8Linears | None,
    mla: bool = False,
):
    """This chunk's n block specs; with ``fp8`` (the run's plan) the blocks it keeps in FP8 (global layer numbers:
    pipeline offset included) get FP8 linears; with experts (``config.moe_layer_freq``, one
    flag per global layer) the MoE layers get megatron's MoE layer."""
    if fp8 is not None:
        from primus.megatron.fp8 import chunk_fp8_flags

        fp8_flags = chunk_fp8_flags(config, fp8, vp_stage=vp_stage, n=n)
    else:
        fp8_flags = [False] * n
    moe_flags = [False] * n
    if config.num_moe_experts:
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        moe_flags = config.moe_layer_freq[offset : offset + n]
    shared = bool(config.moe_shared_expert_intermediate_size)

    @functools.cache
    def spec(moe: bool, in_fp8: bool) -> ModuleSpec:
        block_fp8 = fp8 if in_fp8 else None
        return layer_spec(
            kernels,
            qk_norm=qk_norm,
            fp8=block_fp8,
            moe=moe_spec(kernels, shared, block_fp8) if moe else None,
            mla=mla,
        )

    return [spec(bool(moe), in_fp8) for moe, in_fp8 in zip(moe_flags, fp8_flags, strict=True)]
