"""HF ``config.json`` <-> Primus :class:`ModelConfig`, for the families Primus trains.

The HF side is what ``transformers`` writes (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``MistralForCausalLM``, and with ``model.moe`` ``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM``); both the 4.x
spelling (``rope_theta`` + ``rope_scaling``) and the 5.x one (``rope_parameters``) are read, the 4.x one is written
(5.x reads it too).
"""

from __future__ import annotations

from typing import Any

from primus.core.config import gpt_oss
from primus.core.config.schema import SHAPE_KEYS, ModelConfig
from primus.core.contracts.errors import UserError

# model_type -> (Primus family, HF architecture class)
FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen3_moe": ("qwen3", "Qwen3MoeForCausalLM"),
    "mixtral": ("mistral", "MixtralForCausalLM"),
    "deepseek_v3": ("deepseek", "DeepseekV3ForCausalLM"),
}
MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}
MOE_MODEL_TYPE = {"qwen3": "qwen3_moe", "mistral": "mixtral"}  # Primus family with model.moe -> HF model_type


class HFConfigError(UserError):
    """A HF config Primus cannot represent (names the key and what is allowed)."""


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(hf.get("rope_parameters") or {})
    theta = float(hf.get("rope_theta", params.pop("rope_theta", 10000.0)))  # the pop runs either way
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return theta, None
    if kind not in ("llama3", "linear", "yarn"):
        raise HFConfigError(
            f"config.json rope_scaling.rope_type {kind!r} is not supported; allowed: llama3, linear, yarn"
        )
    out: dict[str, Any] = {"type": kind, "factor": float(scaling["factor"])}
    for key in ("low_freq_factor", "high_freq_factor"):
        if key in scaling:
            out[key] = float(scaling[key])
    if "original_max_position_embeddings" in scaling:
        out["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):  # YaRN's (DeepSeek writes them all)
        if scaling.get(key) is not None:
            out[key] = float(scaling[key])
    return theta, out


def _moe_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any] | None:
    """The architecture fields of ``model.moe`` of a Qwen3-MoE or Mixtral config (None for the dense ones).
    Balancing (``router_aux_loss_coef``) is a training choice, left to the run's config."""
    if model_type == "mixtral":  # every layer routed, top-k renormalised; intermediate_size is an expert's width
        return {
            "num_experts": int(hf["num_local_experts"]),
            "experts_per_token": int(hf["num_experts_per_tok"]),
            "expert_ffn_hidden_size": int(hf["intermediate_size"]),
            "normalize_topk": True,
        }
    experts = hf.get("num_experts") or hf.get("num_local_experts")  # transformers 4.x / 5.x spelling
    if model_type != "qwen3_moe" or not experts:
        return None
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):  # Qwen2-MoE's, DeepSeek's: no Qwen3-MoE has one
        if hf.get(key):
            raise HFConfigError(f"config.json {key} {hf[key]} is not supported (shared experts); allowed: 0 or absent")
    if int(hf.get("decoder_sparse_step", 1)) != 1:
        raise HFConfigError(f"config.json decoder_sparse_step {hf['decoder_sparse_step']} is not supported; allowed: 1")
    dense = sorted(int(i) for i in hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise HFConfigError(
            f"config.json mlp_only_layers {dense} is not supported; allowed: the first N layers ([0, ..., N-1])"
        )
    return {
        "num_experts": int(experts),
        "experts_per_token": int(hf["num_experts_per_tok"]),
        "expert_ffn_hidden_size": int(hf["moe_intermediate_size"]),
        "normalize_topk": bool(hf.get("norm_topk_prob", False)),
        "first_dense_layers": len(dense),
    }


def _moe_to_hf(m: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` fields of ``model.moe`` (Qwen3-MoE for qwen3, Mixtral for mistral / llama)."""
    e = m.moe
    if e.shared_experts or e.layer_frequency != 1 or e.router != "softmax":
        key, value = next(
            (k, v)
            for k, v, ok in (
                ("shared_experts", e.shared_experts, 0),
                ("layer_frequency", e.layer_frequency, 1),
                ("router", e.router, "softmax"),
            )
            if v != ok
        )
        raise HFConfigError(f"model.moe.{key} {value!r} cannot be written as Qwen3-MoE or Mixtral")
    common = {"num_experts_per_tok": e.experts_per_token, "router_aux_loss_coef": e.aux_loss_coeff}
    common["output_router_logits"] = False
    if m.family == "qwen3":
        return common | {
            "num_experts": e.num_experts,
            "moe_intermediate_size": e.expert_ffn_hidden_size,
            "norm_topk_prob": e.normalize_topk,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(e.first_dense_layers)),
        }
    if e.first_dense_layers or not e.normalize_topk:
        key = "first_dense_layers" if e.first_dense_layers else "normalize_topk"
        raise HFConfigError(f"model.moe.{key} {getattr(e, key)!r} cannot be written as Mixtral")
    return common | {"num_local_experts": e.num_experts, "intermediate_size": e.expert_ffn_hidden_size}


def model_fields_from_hf(hf: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """The ``model`` section (a plain dict, validated by the caller) that describes the HF model ``hf``."""
    model_type = hf.get("model_type")
    if model_type == "gpt_oss":
        raise HFConfigError(
            "config.json model_type 'gpt_oss' (GptOssForCausalLM) is not mapped yet: Primus plans GPT-OSS (the "
            f"gpt-oss-20b / gpt-oss-120b presets) and no engine trains it; allowed: {', '.join(FAMILIES)}"
        )
    if model_type not in FAMILIES:
        raise HFConfigError(f"config.json model_type {model_type!r} is not supported; allowed: {', '.join(FAMILIES)}")
    if model_type == "deepseek_v3":
        from primus.core.hf.deepseek import deepseek_fields

        return deepseek_fields(hf, name, _rope(hf), HFConfigError)
    family = FAMILIES[model_type][0]
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"config.json hidden_act {hf['hidden_act']!r} is not supported; allowed: silu")
    if hf.get("mlp_bias"):
        raise HFConfigError("config.json mlp_bias true is not supported; allowed: false")
    window = (
        hf.get("sliding_window") if (model_type in ("mistral", "mixtral") or hf.get("use_sliding_window")) else None
    )
    if window is not None and window < hf.get("max_position_embeddings", 0):
        raise HFConfigError(
            f"config.json sliding_window {window} is not supported (full attention only); allowed: null"
        )
    heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    theta, scaling = _rope(hf)
    fields: dict[str, Any] = {
        "name": name or hf.get("_name_or_path") or model_type,
        "family": family,
        "hidden_size": int(hf["hidden_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(head_dim) if head_dim and int(head_dim) != hf["hidden_size"] // heads else None,
        "ffn_hidden_size": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases (transformers hard-codes them); Llama / Mistral say attention_bias
        "qkv_bias": True if family == "qwen2" else bool(hf.get("attention_bias", False)),
        "qk_norm": family == "qwen3",
        "init_std": float(hf.get("initializer_range", 0.02)),
    }
    if (moe := _moe_from_hf(hf, model_type)) is not None:
        fields["moe"] = moe
    return fields


def model_config_from_hf(hf: dict[str, Any], name: str | None = None) -> ModelConfig:
    return ModelConfig.model_validate(model_fields_from_hf(hf, name))


def hf_config(m: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of a HF model with the architecture ``m`` (what ``from_pretrained`` reads)."""
    if m.family == gpt_oss.FAMILY:
        raise HFConfigError(
            "model.family 'gpt_oss' has no Hugging Face mapping yet (GptOssForCausalLM import / export is not there); "
            "allowed: llama, qwen2, qwen3, mistral, deepseek"
        )
    if parts := gpt_oss.parts(m):
        raise HFConfigError(
            f"{', '.join(parts)} (GPT-OSS's) cannot be written as {m.family}: its Hugging Face model has none; "
            "allowed: their defaults"
        )
    if m.family == "deepseek":
        from primus.core.hf.deepseek import deepseek_config

        return deepseek_config(m, dtype, HFConfigError)
    if m.family == "qwen2" and not m.qkv_bias:
        raise HFConfigError("model.qkv_bias false cannot be written as Qwen2 (transformers' Qwen2 always has it)")
    if m.family in ("llama", "mistral") and m.qk_norm:
        raise HFConfigError(f"model.qk_norm true cannot be written as {m.family}; allowed: family qwen3")
    if m.family == "qwen3" and not m.qk_norm:
        raise HFConfigError("model.qk_norm false cannot be written as Qwen3 (transformers' Qwen3 always has it)")
    if m.moe is not None and m.family not in MOE_MODEL_TYPE and m.family != "llama":
        raise HFConfigError(f"model.family {m.family!r} with model.moe has no HF format; allowed: qwen3, mistral")
    model_type = MODEL_TYPE[m.family] if m.moe is None else MOE_MODEL_TYPE.get(m.family, "mixtral")
    out: dict[str, Any] = {
        "architectures": [FAMILIES[model_type][1]],
        "model_type": model_type,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings,
        "vocab_size": m.vocab_size,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "tie_word_embeddings": m.tie_word_embeddings,
        "initializer_range": m.init_std,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
    if m.moe is not None:
        out |= _moe_to_hf(m)
    if model_type in ("llama", "mistral", "qwen3", "qwen3_moe"):
        out["attention_bias"] = m.qkv_bias
    if model_type == "llama":
        out["mlp_bias"] = False
    if m.family in ("mistral", "qwen2", "qwen3"):
        out["sliding_window"] = None
        out["use_sliding_window"] = False
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        scaling: dict[str, Any] = {"rope_type": rs.type, "factor": rs.factor}
        if rs.type == "llama3":
            scaling |= {"low_freq_factor": rs.low_freq_factor, "high_freq_factor": rs.high_freq_factor}
        if rs.type in ("llama3", "yarn"):
            scaling["original_max_position_embeddings"] = rs.original_max_position_embeddings
        out["rope_scaling"] = scaling
    return out


# What must agree between a run's model and a HF folder it starts from (the weights' shapes and meaning).
ARCH_KEYS = (*SHAPE_KEYS, "rope_theta", "rope_scaling", "norm_eps")
MOE_ARCH_KEYS = ("num_experts", "experts_per_token", "expert_ffn_hidden_size", "first_dense_layers", "normalize_topk")
DEEPSEEK_ARCH_KEYS = ("shared_experts", "router", "expert_groups", "groups_per_token", "scaling_factor")


def _arch(m: ModelConfig) -> dict[str, Any]:
    out = {k: getattr(m, k) for k in ARCH_KEYS}
    if m.moe is not None and not m.moe.first_dense_layers:
        out.pop("ffn_hidden_size")  # no dense MLP (Mixtral's config.json has no width for one)
    out["moe"] = None if m.moe is None else {k: getattr(m.moe, k) for k in MOE_ARCH_KEYS}
    if m.mla is not None:
        out["mla"] = m.mla.model_dump()
        out["moe"] |= {k: getattr(m.moe, k) for k in DEEPSEEK_ARCH_KEYS}
    return out


def check_matches(m: ModelConfig, hf: dict[str, Any], where: str) -> None:
    """Refuse to load HF weights into a model of another architecture, naming every differing key."""
    mine, theirs = _arch(m), _arch(model_config_from_hf(hf))
    diff = [
        f"model.{k} {mine.get(k)!r} vs {theirs.get(k)!r}" for k in dict(mine) | theirs if mine.get(k) != theirs.get(k)
    ]
    if diff:
        raise HFConfigError(
            f"{where}: the HF model in it has another architecture than this run's model ({'; '.join(diff)}; "
            "this run first): use a config whose model matches, or `primus checkpoint import` which takes the "
            "model from config.json"
        )
