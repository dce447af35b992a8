"""DeepSeek-V2/V3's architecture in core: multi-head latent attention (``model.mla``) and DeepSeek's router.

MLA's tensors per layer (d hidden, h heads, r_q ``q_lora_rank`` or none, r ``kv_lora_rank``, n / p / v the nope,
rope and value head dims), by their Hugging Face names (``DeepseekV3ForCausalLM``)::

  q_proj       [h·(n+p), d]            (without q_lora_rank), or
  q_a_proj     [r_q, d]  q_a_layernorm [r_q]  q_b_proj [h·(n+p), r_q]
  kv_a_proj_with_mqa [r + p, d]        the compressed KV and the one RoPE key all heads share
  kv_a_layernorm     [r]
  kv_b_proj          [h·(n+v), r]      the latent up to each head's key (nope part) and value
  o_proj             [d, h·v]

Attention FLOPs per token and layer over S tokens: QKᵀ 2·h·(n+p)·S and AV 2·h·v·S (forward; × 3 with backward).
A DeepSeek MoE layer's router has a bias (``mlp.gate.e_score_correction_bias``, loss-free balancing's; added to the
scores for the choice of experts only), so it is one of the layer's tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from primus.core.contracts.protocols import ConfigIssue

if TYPE_CHECKING:
    from primus.core.config.schema import ModelConfig

ROUTER_BIAS = "mlp.gate.e_score_correction_bias"


def attention_names(m: ModelConfig, prefix: str) -> dict[str, str]:
    """Role -> HF name of layer ``prefix``'s MLA tensors (roles ending in ``norm`` are RMSNorm weights)."""
    p = prefix + "self_attn."
    if m.mla.q_lora_rank:
        names = {"q_a": p + "q_a_proj.weight", "q_a_norm": p + "q_a_layernorm.weight", "q_b": p + "q_b_proj.weight"}
    else:
        names = {"q": p + "q_proj.weight"}
    return names | {
        "kv_a": p + "kv_a_proj_with_mqa.weight",
        "kv_a_norm": p + "kv_a_layernorm.weight",
        "kv_b": p + "kv_b_proj.weight",
        "o": p + "o_proj.weight",
    }


def attention_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Role -> shape of the MLA tensors (:func:`attention_names`)."""
    a, d, h = m.mla, m.hidden_size, m.num_attention_heads
    qk, rq = h * a.qk_head_dim, a.q_lora_rank or 0
    return {
        "q": (qk, d),
        "q_a": (rq, d),
        "q_a_norm": (rq,),
        "q_b": (qk, rq),
        "kv_a": (a.kv_lora_rank + a.qk_rope_head_dim, d),
        "kv_a_norm": (a.kv_lora_rank,),
        "kv_b": (h * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
        "o": (d, h * a.v_head_dim),
    }


def attention_linears(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """Role -> (in_features, out_features) of one block's MLA linears, whole (what FP8's shape rule weighs)."""
    shapes = attention_shapes(m)
    return {role: (shapes[role][1], shapes[role][0]) for role in attention_names(m, "") if not role.endswith("norm")}


#: the MLA linears a tensor-parallel run keeps whole on every rank (torchtitan's plan: NoParallel): the down
#: projections; q (without a query latent), q_b and kv_b are split by output (column-wise), o by input (row-wise):
#: primus.core.kernels.linears.attention_linears
WHOLE_UNDER_TP = ("q_a", "kv_a")


def attention_params(m: ModelConfig) -> tuple[int, int]:
    """(MLA parameters of one layer, of them the RMSNorm weights)."""
    shapes = attention_shapes(m)
    roles = attention_names(m, "")
    total = norms = 0
    for role in roles:
        n = 1
        for s in shapes[role]:
            n *= s
        total += n
        norms += n if role.endswith("norm") else 0
    return total, norms


def attention_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs of QKᵀ and AV per token (no causal discount, as modelmath counts them)."""
    a = m.mla
    return 6.0 * m.num_layers * m.num_attention_heads * (a.qk_head_dim + a.v_head_dim) * seq_len


def kv_cache_per_token(m: ModelConfig) -> int:
    """Values a KV cache keeps per token and layer: MLA's compressed latent and the shared RoPE key."""
    return m.mla.kv_lora_rank + m.mla.qk_rope_head_dim


def issues(m: ModelConfig) -> list[ConfigIssue]:
    """The config rules of MLA and DeepSeek's group-limited router, each at the key a user would change."""
    out: list[ConfigIssue] = []
    if (m.family == "deepseek") != (m.mla is not None):
        key, value = ("model.mla", None) if m.family == "deepseek" else ("model.family", m.family)
        why = "family deepseek is multi-head latent attention: it and model.mla go together"
        out.append(ConfigIssue(key, why, value=value, allowed="family deepseek with model.mla set"))
    if m.mla is not None:
        a = m.mla
        if a.qk_rope_head_dim % 2:
            out.append(
                ConfigIssue("model.mla.qk_rope_head_dim", "RoPE rotates pairs of dims", a.qk_rope_head_dim, "even")
            )
        for key in ("qkv_bias", "qk_norm"):
            if getattr(m, key):
                out.append(ConfigIssue(f"model.{key}", "multi-head latent attention has none", True, "false"))
        if m.num_kv_heads != m.num_attention_heads:
            why = "multi-head latent attention gives every query head its own key and value"
            out.append(ConfigIssue("model.num_kv_heads", why, m.num_kv_heads, str(m.num_attention_heads)))
        rs = m.rope_scaling
        if rs is not None and rs.type != "yarn":
            out.append(ConfigIssue("model.rope_scaling.type", "DeepSeek's long context is YaRN", rs.type, "yarn"))
    if m.mtp is not None and m.family != "deepseek":
        why = "multi-token prediction is DeepSeek-V3's (its layers have DeepSeek's Hugging Face names)"
        out.append(ConfigIssue("model.mtp", why, value=m.mtp.layers, allowed="null, or model.family: deepseek"))
    e = m.moe
    if e is not None and (e.expert_groups > 1 or e.groups_per_token > 1):
        if e.num_experts % e.expert_groups or e.num_experts // e.expert_groups < 2:
            why = f"must split model.moe.num_experts {e.num_experts} into groups of 2 or more (top-2 group scores)"
            out.append(ConfigIssue("model.moe.expert_groups", why, e.expert_groups))
        elif e.groups_per_token > e.expert_groups:
            why = f"exceeds model.moe.expert_groups {e.expert_groups}"
            out.append(ConfigIssue("model.moe.groups_per_token", why, e.groups_per_token, f"1..{e.expert_groups}"))
        elif e.experts_per_token > e.groups_per_token * (e.num_experts // e.expert_groups):
            why = "more experts per token than its groups hold"
            out.append(ConfigIssue("model.moe.experts_per_token", why, e.experts_per_token))
    return out


def head_width(m: ModelConfig) -> float:
    """The per-head width attention's FLOPs scale with (QKᵀ over the q/k dims, AV over the value dims): their mean
    under MLA (DeepSeek-V3: (192 + 128) / 2 = 160, not hidden / heads = 56), the head dim otherwise."""
    return m.kv_channels if m.mla is None else (m.mla.qk_head_dim + m.mla.v_head_dim) / 2


def attention_activation_elements(m: ModelConfig) -> float:
    """Elements per token one attention layer keeps for its backward: q, k, v and the attention output
    (``2·h·c + 2·kv·c`` with GQA); MLA's q and k of the q/k head width, v and the output of the value width, plus its
    latents and their norm outputs (the compressed KV: ``kv_lora_rank + qk_rope_head_dim``)."""
    h = m.num_attention_heads
    if m.mla is None:
        return 2 * h * m.kv_channels + 2 * m.num_kv_heads * m.kv_channels
    a = m.mla
    latents = 2 * (a.q_lora_rank or 0) + 2 * a.kv_lora_rank + a.qk_rope_head_dim
    return 2 * h * a.qk_head_dim + 2 * h * a.v_head_dim + latents
