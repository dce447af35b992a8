"""Primus config -> megatron-core TransformerConfig and GPTModel chunks (one per virtual stage)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from primus.core.config.schema import PrimusConfig
from primus.core.contracts.protocols import KernelProvider
from primus.megatron import compat
from primus.megatron.dist import stage
from primus.megatron.experts import experts_apart
from primus.megatron.fp8 import plan as fp8_plan
from primus.megatron.gpt import fuse_loss, fused_loss
from primus.megatron.layer_spec import block_spec, mtp_block_spec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# TransformerConfig fields that switch off megatron's fused paths (they need TE / apex / CUDA JIT),
# so every module goes through the layer spec we build.
UNFUSED = dict(
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
)


def pipeline_p2p(pp: int, vpp: int) -> dict[str, bool]:
    """How pipeline stages exchange activations and gradients. megatron-core's ModelParallelConfig defaults to
    batched p2p (``batch_isend_irecv``), which posts a rank's send to the previous stage before its send to the
    next, and its receive from the previous stage before the one from the next. With pp = 2 both neighbours are
    one peer, NCCL and gloo match one peer's messages in posting order, and the interleaved schedule (the only
    one that sends both ways in one call) then puts an activation into a gradient's buffer of the same shape:
    silently (on 2 H200s the loss was off from step 1 and rose after step 3). Megatron-LM's own defaults for
    interleaving are unbatched, overlapped p2p, whose sends and receives are ordered by rank parity."""
    if pp > 1 and vpp > 1:
        return {"batch_p2p_comm": False, "overlap_p2p_comm": True}
    return {}


def transformer_config(cfg: PrimusConfig) -> TransformerConfig:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dtype = DTYPES[t.precision]
    recompute: dict[str, Any] = {}
    if p.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif p.recompute == "full":
        layers_per_stage = m.num_layers // (p.pp * p.vpp)
        recompute = dict(
            recompute_granularity="full",
            recompute_method=p.recompute_method,
            recompute_num_layers=p.recompute_layers or (1 if p.recompute_method == "uniform" else layers_per_stage),
        )
    extra = {**pipeline_p2p(p.pp, p.vpp), **cfg.backend.extra.get("transformer_config", {})}
    config_cls = TransformerConfig
    if m.mla is not None:  # multi-head latent attention: primus.megatron.deepseek
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        from primus.megatron.deepseek import mla_fields

        config_cls, extra = MLATransformerConfig, {**mla_fields(m), **extra}
    return config_cls(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_kv_heads,
        kv_channels=m.kv_channels,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=m.qkv_bias,
        qk_layernorm=m.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_std,
        tensor_model_parallel_size=p.tp,
        sequence_parallel=p.sequence_parallel,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
        context_parallel_size=p.cp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        calculate_per_token_loss=cfg.train.objective == "sft",  # masked labels: megatron's per-token mode
        mtp_num_layers=m.mtp.layers if m.mtp is not None else None,
        mtp_loss_scaling_factor=m.mtp.loss_scale if m.mtp is not None else 0.1,
        **moe_fields(cfg),
        **{compat.PLUGGABLE_ACTIVATION_FLAG: True},
        **UNFUSED,
        **recompute,
        **extra,
    )


def balancing_losses(e: Any) -> list[tuple[str, float]]:
    """megatron's load-balancing losses and their weights (its TopKRouter takes a list): Switch's over the routed
    batch (``balancing: aux_loss``) and DeepSeek-V3's over each sequence (``seq_aux_loss_coeff``), either, both or
    none."""
    out = [("aux_loss", e.aux_loss_coeff)] if e.balancing == "aux_loss" else []
    return out + ([("seq_aux_loss", e.seq_aux_loss_coeff)] if e.seq_aux_loss_coeff > 0 else [])


def moe_fields(cfg: PrimusConfig) -> dict[str, Any]:
    """model.moe as megatron-core's MoE settings: a router over ``num_experts`` local SwiGLU experts (the layer spec
    runs them as grouped GEMMs over stacked weights, primus.megatron.experts, not megatron's ``moe_grouped_gemm``,
    which needs Transformer Engine or the grouped_gemm package), all-to-all token dispatch over the expert-parallel
    ranks, no token dropping unless a capacity is set."""
    m = cfg.model
    if m.moe is None:
        return {}
    compat.moe_without_te()
    from primus.megatron.deepseek import router_fields

    e = m.moe
    losses = balancing_losses(e) or [("none", 0.0)]
    return dict(
        num_moe_experts=e.num_experts,
        moe_router_topk=e.experts_per_token,
        moe_ffn_hidden_size=e.expert_ffn_hidden_size,
        moe_shared_expert_intermediate_size=e.shared_experts * e.expert_ffn_hidden_size or None,
        moe_layer_freq=[int(e.is_moe_layer(i)) for i in range(m.num_layers)],
        moe_router_score_function=e.router,
        # softmax: top-k of the logits then a softmax over them is the renormalised top-k of the softmax
        moe_router_pre_softmax=not e.normalize_topk,
        moe_router_load_balancing_type=[t for t, _ in losses] if len(losses) > 1 else losses[0][0],
        moe_router_enable_expert_bias=e.balancing == "loss_free",
        moe_aux_loss_coeff=[c for _, c in losses] if len(losses) > 1 else losses[0][1],
        moe_expert_capacity_factor=e.capacity_factor,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        expert_model_parallel_size=cfg.parallel.ep,
        expert_tensor_parallel_size=1,  # as dist.init_parallel builds the groups
    ) | (router_fields(m) if m.family == "deepseek" else {})


def gpt_model(
    config: TransformerConfig,
    spec: Any,
    *,
    vocab_size: int,
    max_seq: int,
    tied: bool,
    rope_theta: float,
    rope_scaling: Any,
    vp_stage: int | None,
    mtp: Any = None,
) -> GPTModel:
    """GPTModel with RoPE; Llama-3 scaling through megatron's own ``rope_scaling`` arguments (0.16
    exposes only the factor; the other three llama3 constants are re-applied when they differ:
    :func:`primus.megatron.compat.llama3_rope_constants`)."""
    first, last = stage(vp_stage)
    llama3 = rope_scaling is not None and rope_scaling.type == "llama3"
    linear = rope_scaling is not None and rope_scaling.type == "linear"
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_seq,
        pre_process=first,
        post_process=last,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_base=int(rope_theta) if float(rope_theta).is_integer() else rope_theta,
        rope_scaling=llama3,
        rope_scaling_factor=rope_scaling.factor if llama3 else 8.0,
        seq_len_interpolation_factor=rope_scaling.factor if linear else None,
        vp_stage=vp_stage,
        mtp_block_spec=mtp,
    )
    if llama3:
        compat.llama3_rope_constants(model, config.kv_channels, rope_theta, rope_scaling)
    return model


def build_chunks(
    cfg: PrimusConfig, config: TransformerConfig, kernels: dict[str, KernelProvider]
) -> list[torch.nn.Module]:
    """This rank's model chunks (vpp of them), unwrapped, on the current device."""
    m = cfg.model
    fused, _ = fused_loss(kernels, cfg)
    fp8 = fp8_plan(cfg, kernels)
    chunks = []
    for vp in range(cfg.parallel.vpp):
        vp_stage = vp if cfg.parallel.vpp > 1 else None
        block = block_spec(
            config,
            kernels,
            qk_norm=m.qk_norm,
            vp_stage=vp_stage,
            fp8=fp8,
            mla=m.mla is not None,
        )
        model = gpt_model(
            config,
            block,
            vocab_size=m.vocab_size,
            max_seq=max(cfg.train.seq_len, 1),
            tied=m.tie_word_embeddings,
            rope_theta=m.rope_theta,
            rope_scaling=m.rope_scaling,
            vp_stage=vp_stage,
            mtp=mtp_block_spec(config, block, kernels, vp_stage),
        )
        if fused is not None:
            fuse_loss(model, fused)
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        experts_reduced_over_their_group(model, config)
        chunks.append(model.to(torch.cuda.current_device()))
    return chunks


def experts_reduced_over_their_group(model: torch.nn.Module, config: TransformerConfig) -> None:
    """Mark the routed experts' parameters ``allreduce = False`` where :func:`experts_apart`: megatron's DDP then sums
    their gradients over the experts' data-parallel group (at TP 2 both tensor-parallel ranks' tokens). Megatron's
    expert linears mark them by EP alone (its default splits experts over TP, where the dense group is right): at
    EP 1 × TP 2 each rank's experts trained on their half of the tokens' gradient."""
    if not experts_apart(config):
        return
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False
