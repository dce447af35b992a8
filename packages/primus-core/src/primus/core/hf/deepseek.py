"""HF ``config.json`` of ``DeepseekV3ForCausalLM`` <-> a Primus model of family ``deepseek`` (``model.mla`` and
DeepSeek's ``model.moe``, its multi-token-prediction depths ``num_nextn_predict_layers`` as ``model.mtp``). Every
field that changes the weights or the forward pass is mapped or refused by name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from primus.core.config.schema import ModelConfig


def deepseek_fields(
    hf: dict[str, Any], name: str | None, rope: tuple[float, dict[str, Any] | None], error: type[Exception]
) -> dict[str, Any]:
    """The ``model`` section (a plain dict) of a DeepSeek-V3 ``config.json``; ``error``: what a field Primus cannot
    represent raises (:class:`primus.core.hf.config.HFConfigError`)."""
    refused = {
        "hidden_act": ("silu", hf.get("hidden_act", "silu")),
        "attention_bias": (False, bool(hf.get("attention_bias", False))),
        "moe_layer_freq": (1, int(hf.get("moe_layer_freq", 1))),
        "topk_method": ("noaux_tc", hf.get("topk_method", "noaux_tc")),
        "scoring_func": ("sigmoid", hf.get("scoring_func", "sigmoid")),
        "rope_interleave": (True, bool(hf.get("rope_interleave", True))),
    }
    for key, (allowed, value) in refused.items():
        if value != allowed:
            raise error(f"config.json {key} {value!r} is not supported; allowed: {allowed!r}")
    theta, scaling = rope
    if scaling is not None and scaling["type"] != "yarn":
        raise error(f"config.json rope_scaling type {scaling['type']!r} is not supported for DeepSeek; allowed: yarn")
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    if kv_heads != heads:
        raise error(f"config.json num_key_value_heads {kv_heads} is not supported (MLA); allowed: {heads}")
    mtp = int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0)
    return {
        "name": name or hf.get("_name_or_path") or "deepseek_v3",
        "family": "deepseek",
        "hidden_size": int(hf["hidden_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_kv_heads": heads,
        "ffn_hidden_size": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "max_position_embeddings": int(hf.get("max_position_embeddings", 4096)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": float(hf.get("initializer_range", 0.02)),
        "mla": {
            "q_lora_rank": int(hf["q_lora_rank"]) if hf.get("q_lora_rank") else None,
            "kv_lora_rank": int(hf["kv_lora_rank"]),
            "qk_nope_head_dim": int(hf["qk_nope_head_dim"]),
            "qk_rope_head_dim": int(hf["qk_rope_head_dim"]),
            "v_head_dim": int(hf["v_head_dim"]),
        },
        "moe": {
            "num_experts": int(hf.get("n_routed_experts") or hf["num_local_experts"]),
            "experts_per_token": int(hf["num_experts_per_tok"]),
            "expert_ffn_hidden_size": int(hf["moe_intermediate_size"]),
            "shared_experts": int(hf.get("n_shared_experts") or 0),
            "first_dense_layers": int(hf.get("first_k_dense_replace") or 0),
            "expert_groups": int(hf.get("n_group") or 1),
            "groups_per_token": int(hf.get("topk_group") or 1),
            "scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
            "router": "sigmoid",
            "normalize_topk": bool(hf.get("norm_topk_prob", True)),
            "balancing": "loss_free",
        },
        "mtp": {"layers": mtp} if mtp else None,
    }


def deepseek_config(m: ModelConfig, dtype: str, error: type[Exception]) -> dict[str, Any]:
    """The ``config.json`` of ``DeepseekV3ForCausalLM`` with the architecture ``m``."""
    e, a = m.moe, m.mla
    if e is None:
        raise error("model.moe null cannot be written as DeepSeek-V3 (its layers after the dense ones are MoE)")
    for key, value, allowed in (
        ("router", e.router, "sigmoid"),
        ("layer_frequency", e.layer_frequency, 1),
    ):
        if value != allowed:
            raise error(f"model.moe.{key} {value!r} cannot be written as DeepSeek-V3; allowed: {allowed!r}")
    out: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "moe_intermediate_size": e.expert_ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads,
        "n_shared_experts": e.shared_experts,
        "n_routed_experts": e.num_experts,
        "num_experts_per_tok": e.experts_per_token,
        "routed_scaling_factor": e.scaling_factor,
        "n_group": e.expert_groups,
        "topk_group": e.groups_per_token,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": e.normalize_topk,
        "first_k_dense_replace": e.first_dense_layers,
        "moe_layer_freq": 1,
        "q_lora_rank": a.q_lora_rank,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings,
        "vocab_size": m.vocab_size,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_interleave": True,
        "tie_word_embeddings": m.tie_word_embeddings,
        "initializer_range": m.init_std,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": m.mtp.layers if m.mtp is not None else 0,
        "num_mtp_layers": m.mtp.layers if m.mtp is not None else 0,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
    if (rs := m.rope_scaling) is not None:
        out["rope_scaling"] = {
            "rope_type": "yarn",
            "type": "yarn",
            "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
            "mscale": rs.mscale,
            "mscale_all_dim": rs.mscale_all_dim,
        }
    return out
