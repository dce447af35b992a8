"""DeepSeek-V3-class models (``model.family: deepseek``) on megatron-core (0.16.1, 0.19.2): multi-head latent attention
through its ``MLASelfAttention`` with a local (non-Transformer-Engine) spec (the linears are megatron's own
tensor-parallel ones, the two latent norms and the core attention Primus's providers: it runs on the CPU), and
DeepSeek's router through ``TopKRouter`` (sigmoid scores + the expert bias, group-limited top-k, the routed
scaling factor).

Where megatron differs from DeepSeek-V3's definition, the config is refused by name (:func:`issues`): its
group-limited routing ranks a group by its top ``experts_per_token / groups_per_token`` scores (DeepSeek-V3's
8 / 4: the top 2, as transformers); a sigmoid router always renormalises its top-k; under tensor parallelism its
latent attention needs sequence parallelism (:func:`whole_linear`).
"""

from __future__ import annotations

from typing import Any

from primus.core.config.schema import ModelConfig, PrimusConfig
from primus.core.contracts.protocols import ConfigIssue


def mla_fields(m: ModelConfig) -> dict[str, Any]:
    """``MLATransformerConfig``'s fields of ``model.mla`` (and of YaRN: megatron's MLA owns its RoPE)."""
    from primus.megatron import compat

    compat.mla_without_te()
    a, rs = m.mla, m.rope_scaling
    out: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank,
        qk_head_dim=a.qk_nope_head_dim,
        qk_pos_emb_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
        rotary_base=m.rope_theta,
        rope_type="rope" if rs is None else "yarn",
        rotary_scaling_factor=1.0 if rs is None else rs.factor,
        mscale=1.0 if rs is None else rs.mscale,
        mscale_all_dim=0.0 if rs is None else rs.mscale_all_dim,
    )
    if rs is not None:
        out |= dict(
            original_max_position_embeddings=rs.original_max_position_embeddings,
            beta_fast=rs.beta_fast,
            beta_slow=rs.beta_slow,
        )
    return out


def router_fields(m: ModelConfig) -> dict[str, Any]:
    """DeepSeek's router options of megatron's TopKRouter."""
    e = m.moe
    out: dict[str, Any] = {"moe_router_topk_scaling_factor": e.scaling_factor if e.scaling_factor != 1.0 else None}
    if e.router == "sigmoid":  # the routing bias is part of the model (its HF folders hold it); none: not updated
        out |= {"moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 1e-3 * (e.balancing != "none")}
    if e.expert_groups > 1:
        out |= {"moe_router_num_groups": e.expert_groups, "moe_router_group_topk": e.groups_per_token}
    return out


def attention_spec(norm: Any, core_attention: Any, linears: dict[str, Any] | None = None) -> Any:
    """MLASelfAttention (:func:`primus.megatron.compat.mla_self_attention`: the latent norms as the spec gives them)
    with megatron's local linears, ``norm`` (the spec of both latent RMSNorms) and ``core_attention`` (Primus's
    provider attention; both from :mod:`primus.megatron.layer_spec`); ``linears`` replaces some (FP8 ones:
    :func:`primus.megatron.fp8.linear_specs`)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from primus.megatron import compat

    down = whole_linear()
    return ModuleSpec(
        module=compat.mla_self_attention(),
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            **{
                "linear_q_proj": ColumnParallelLinear,
                "linear_q_down_proj": down,
                "linear_q_up_proj": ColumnParallelLinear,
                "linear_kv_down_proj": down,
                "linear_kv_up_proj": ColumnParallelLinear,
                "linear_proj": RowParallelLinear,
                **(linears or {}),
            },
            core_attention=core_attention,
            q_layernorm=norm,
            kv_layernorm=norm,
        ),
    )


def whole_linear() -> type:
    """The down projections' class: megatron's replicated ``Linear`` (the one MLASelfAttention accepts besides
    TE's), whole on every tensor-parallel rank as DeepSeek's reference splits them. Megatron's other choice, a
    ColumnParallelLinear, loses part of the decoupled RoPE key's gradient under TP: each rank's share of the key
    (its heads') is never summed over ranks. The replicated one's key goes through the sequence-parallel gather,
    whose backward sums it, and its weight is marked sequence-parallel, so megatron sums its gradient too. (Read from
    megatron's module, where :func:`primus.megatron.compat.mla_without_te` puts it on both releases: MLASelfAttention
    accepts only the class held there.)"""
    from megatron.core.transformer import multi_latent_attention as mla

    from primus.megatron import compat

    compat.mla_without_te()
    return mla.Linear


def issues(cfg: PrimusConfig) -> list[ConfigIssue]:
    from primus.core.kernels.documents import masks_documents  # (imports torch: not at the module's import)

    m, out = cfg.model, []
    if m.family != "deepseek":
        return out
    e = m.moe
    if e is not None and e.expert_groups > 1 and e.experts_per_token != 2 * e.groups_per_token:
        why = (
            "megatron-core ranks an expert group by its top experts_per_token / groups_per_token scores, DeepSeek "
            "by its top 2"
        )
        allowed = f"{2 * e.groups_per_token} (2 × model.moe.groups_per_token)"
        out.append(ConfigIssue("model.moe.experts_per_token", why, value=e.experts_per_token, allowed=allowed))
    if e is not None and e.router == "sigmoid" and not e.normalize_topk and e.experts_per_token > 1:
        why = "megatron-core's sigmoid router always renormalises its top-k scores"
        out.append(ConfigIssue("model.moe.normalize_topk", why, value=False, allowed="true"))
    if m.mtp is not None and masks_documents(cfg):
        why = "multi-token prediction rolls the tokens one place per depth, not the document ids the attention masks by"
        if cfg.data.document_mask:
            out.append(ConfigIssue("data.document_mask", why, value=True, allowed="false, or model.mtp: null"))
        else:
            allowed = "stream or padded, or model.mtp: null"
            out.append(ConfigIssue("data.sft_packing", why, value=cfg.data.sft_packing, allowed=allowed))
    if m.mla is not None and cfg.parallel.tp > 1 and not cfg.parallel.sequence_parallel:
        why = (
            "megatron-core sums the decoupled RoPE key's gradient over tensor-parallel ranks only in the "
            "sequence-parallel gather of multi-head latent attention"
        )
        out.append(ConfigIssue("parallel.sequence_parallel", why, value=False, allowed="true, or parallel.tp: 1"))
    return out
