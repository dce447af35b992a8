"""Primus model configs -> torchtitan model args, and the TrainSpec each run registers.

Llama 3.x and Mistral (architecturally Llama: GQA, SwiGLU, RMSNorm, RoPE) use torchtitan's ``llama3``
model and Qwen3 its ``qwen3`` model, from torchtitan's registry. What llama3 lacks (tied embeddings,
Qwen2.5's qkv bias) runs on Primus's registration ``primus_dense`` (:mod:`primus.torchtitan.dense`:
llama3 plus those two). What none can express is refused in :mod:`primus.torchtitan.validate`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from primus.core.config.schema import ModelConfig

# family -> the torchtitan model (registry name) that runs it
ENGINE_MODEL = {"llama": "llama3", "mistral": "llama3", "qwen3": "qwen3", "deepseek": "deepseek_v3"}

FLAVOR = "primus"  # the flavor name a run registers its model args under


def engine_model(m: ModelConfig) -> str:
    """The registry name of the model that runs ``m``: torchtitan's, or ``dense`` (Primus's)."""
    if m.family == "qwen2" or (m.family in ("llama", "mistral") and (m.tie_word_embeddings or m.qkv_bias)):
        return "dense"
    return ENGINE_MODEL[m.family]


def llama3_ffn_args(hidden: int, ffn: int) -> tuple[int, float]:
    """(multiple_of, ffn_dim_multiplier) for which torchtitan's llama3 FeedForward builds exactly ``ffn``.

    It computes ``round_up(int(mult * int(2 * 4 * hidden / 3)), multiple_of)``: with ``multiple_of = ffn``
    any product in (0, ffn] rounds up to ``ffn``."""
    base = int(2 * 4 * hidden / 3)
    mult = 1.0 if base <= ffn else ffn / base
    while int(mult * base) > ffn:  # float rounding
        mult = mult * (1 - 1e-9)
    return ffn, mult


def llama3_args(m: ModelConfig, seq_len: int, args_cls: Any = None, **extra: Any) -> Any:
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    multiple_of, mult = llama3_ffn_args(m.hidden_size, m.ffn_hidden_size)
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        scaling = RoPEScalingArgs(
            scaling_factor=rs.factor,
            low_freq_factor=rs.low_freq_factor,
            high_freq_factor=rs.high_freq_factor,
            original_max_position_embeddings=rs.original_max_position_embeddings,
        )
    else:
        # torchtitan always applies llama3 scaling; a factor of 1 leaves every frequency unchanged
        scaling = RoPEScalingArgs(scaling_factor=1.0)
    return (args_cls or TransformerModelArgs)(
        dim=m.hidden_size,
        n_layers=m.num_layers,
        n_heads=m.num_attention_heads,
        n_kv_heads=m.num_kv_heads,
        vocab_size=m.vocab_size,
        multiple_of=multiple_of,
        ffn_dim_multiplier=mult,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        rope_scaling_args=scaling,
        max_seq_len=seq_len,
        attn_type="sdpa",
        **extra,
    )


def dense_args(m: ModelConfig, seq_len: int) -> Any:
    from primus.torchtitan.dense import DenseModelArgs

    return llama3_args(m, seq_len, DenseModelArgs, qkv_bias=m.qkv_bias, tie_word_embeddings=m.tie_word_embeddings)


def moe_args(m: ModelConfig) -> dict[str, Any]:
    """model.moe as torchtitan 0.2.2's qwen3 MoE (every layer: a router, ``num_experts`` SwiGLU experts, shared
    experts as one FeedForward of their summed width), the router weight applied to each expert's output as in
    Megatron-Core; loss-free balancing is torchtitan's expert-bias update (rate 1e-3, Megatron's default). The
    experts run on the grouped_gemm provider (:class:`~primus.torchtitan.kernels.ProviderGroupedExperts`); with
    core's reference, torchtitan's own: grouped GEMMs on a GPU, a loop on CPU (its grouped path casts to bf16)."""
    if m.moe is None:
        return {}
    import torch
    from torchtitan.models.moe import MoEArgs

    e = m.moe
    return {
        "moe_enabled": True,
        "moe_inter_dim": e.expert_ffn_hidden_size,
        "moe_args": MoEArgs(
            num_experts=e.num_experts,
            num_shared_experts=e.shared_experts,
            score_func=e.router,
            route_norm=e.normalize_topk,
            route_scale=e.scaling_factor,
            num_expert_groups=e.expert_groups if e.expert_groups > 1 else None,
            num_limited_groups=e.groups_per_token if e.expert_groups > 1 else None,
            score_before_experts=False,
            top_k=e.experts_per_token,
            use_grouped_mm=torch.cuda.is_available(),
            load_balance_coeff=1e-3 if e.balancing == "loss_free" else None,
        ),
    }


def qwen3_args(m: ModelConfig, seq_len: int) -> Any:
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    return Qwen3ModelArgs(
        **moe_args(m),
        dim=m.hidden_size,
        n_layers=m.num_layers,
        n_heads=m.num_attention_heads,
        n_kv_heads=m.num_kv_heads,
        vocab_size=m.vocab_size,
        head_dim=m.kv_channels,
        hidden_dim=m.ffn_hidden_size,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        qk_norm=m.qk_norm,
        max_seq_len=seq_len,
        enable_weight_tying=m.tie_word_embeddings,
        attn_type="sdpa",
    )


def model_args(m: ModelConfig, seq_len: int) -> Any:
    kind = engine_model(m)
    if kind == "deepseek_v3":  # (its module subclasses torchtitan's DeepSeek-V3 classes: imported for it alone)
        from primus.torchtitan.deepseek import deepseek_args

        return deepseek_args(m, seq_len)
    return {"llama3": llama3_args, "qwen3": qwen3_args, "dense": dense_args}[kind](m, seq_len)


def base_train_spec(m: ModelConfig) -> Any:
    """The TrainSpec of the model that runs ``m``: torchtitan's own, or llama3's with Primus's dense model."""
    from torchtitan.protocols.train_spec import get_train_spec

    if engine_model(m) == "deepseek_v3":
        from primus.torchtitan.deepseek import train_spec as deepseek_spec

        return deepseek_spec()
    if engine_model(m) != "dense":
        return get_train_spec(engine_model(m))
    from primus.torchtitan.dense import DenseTransformer, parallelize_dense

    spec = get_train_spec("llama3")
    return dataclasses.replace(spec, model_cls=DenseTransformer, parallelize_fn=parallelize_dense(spec.parallelize_fn))


def train_spec(
    m: ModelConfig,
    seq_len: int,
    *,
    build_dataloader_fn: Any,
    build_metrics_processor_fn: Any,
    cpu: bool,
    kernels: dict[str, Any] | None = None,
) -> Any:
    """torchtitan's TrainSpec for the model with this run's args as flavor :data:`FLAVOR`, Primus's data
    loader and metrics, no tokenizer/validator (data arrives tokenized), the kernel providers of
    ``kernels`` (op -> :class:`primus.torchtitan.kernels.Choice`) swapped in, and on CPU the gloo adaptation."""
    from primus.torchtitan import compat
    from primus.torchtitan.kernels import loss_builder, swapping_parallelize

    spec = base_train_spec(m)
    parallelize = compat.gloo_parallelize(spec.parallelize_fn) if cpu else spec.parallelize_fn
    if m.moe is not None:
        parallelize = compat.moe_parallelize(parallelize)
    kernels = kernels or {}
    if any(c.fn is not None for c in kernels.values()):
        parallelize = swapping_parallelize(parallelize, kernels)
    pipelining = spec.pipelining_fn
    if pipelining is None and engine_model(m) == "qwen3":
        # 0.2.2 registers no pipeline split for qwen3; its decoder has llama3's module layout
        from torchtitan.distributed.pipeline_parallel import pipeline_llm as pipelining
    return dataclasses.replace(
        spec,
        pipelining_fn=pipelining,
        model_args={FLAVOR: model_args(m, seq_len)},
        parallelize_fn=parallelize,
        build_dataloader_fn=build_dataloader_fn,
        build_tokenizer_fn=None,
        build_validator_fn=None,
        build_metrics_processor_fn=build_metrics_processor_fn,
        build_loss_fn=loss_builder(
            spec.build_loss_fn, kernels.get("cross_entropy"), kernels.get("linear_cross_entropy")
        ),
        state_dict_adapter=None,
    )
