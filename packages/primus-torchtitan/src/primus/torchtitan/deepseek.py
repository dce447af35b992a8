"""DeepSeek-V3-class models (``model.family: deepseek``) on torchtitan 0.2.2's own ``deepseek_v3`` model: MLA,
its MoE (sigmoid or softmax scores, the expert-bias update, group-limited top-k, the routed scaling factor, shared
experts) and the first dense layers, mapped from Primus's config.

Two differences from ``transformers``' DeepseekV3ForCausalLM are closed here, so that the logits are the same:
torchtitan applies YaRN (the frequencies and the softmax scale's mscale) only when the run's sequence exceeds
the original context, transformers whenever the config has it: :class:`PrimusDeepSeekV3Args` keeps its RoPE table
one position past the original context when YaRN is on (longer tables are only sliced). Its final RMSNorm takes
torch's default epsilon: :class:`PrimusDeepSeekV3Model` gives it ``model.norm_eps``. The routing bias is in every
model (DeepSeek's HF folders hold it); with ``model.moe.balancing: none`` it is kept and never updated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from primus.core.config.schema import ModelConfig
from primus.torchtitan import compat

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs  # noqa: E402
from torchtitan.models.moe import MoEArgs  # noqa: E402

NO_YARN = 2**62  # an original context no run exceeds: torchtitan leaves the RoPE frequencies and scale alone


@dataclasses.dataclass
class PrimusDeepSeekV3Args(DeepSeekV3ModelArgs):
    freeze_expert_bias: bool = False  # keep the routing bias, never update it (model.moe.balancing: none)

    def update_from_config(self, job_config: Any, **kwargs: Any) -> None:
        super().update_from_config(job_config, **kwargs)
        self.max_seq_len = self.yarn_seq_len(self.max_seq_len)

    def yarn_seq_len(self, seq_len: int) -> int:
        return max(seq_len, self.original_seq_len + 1) if self.original_seq_len != NO_YARN else seq_len


class PrimusDeepSeekV3Model(DeepSeekV3Model):
    def __init__(self, model_args: DeepSeekV3ModelArgs):
        super().__init__(model_args)
        self.norm.eps = model_args.norm_eps
        if getattr(model_args, "freeze_expert_bias", False):
            # torchtitan registers the bias only with a positive rate, and updates it when the rate is truthy
            for layer in self.layers.values():
                if layer.moe_enabled:
                    layer.moe.load_balance_coeff = 0.0


def deepseek_args(m: ModelConfig, seq_len: int) -> PrimusDeepSeekV3Args:
    import torch

    e, a, rs = m.moe, m.mla, m.rope_scaling
    yarn = {"original_seq_len": NO_YARN, "rope_factor": 1.0}
    if rs is not None:
        yarn = {
            "original_seq_len": rs.original_max_position_embeddings,
            "rope_factor": rs.factor,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
            "mscale": rs.mscale_all_dim,  # torchtitan's mscale is the softmax scale's (transformers' mscale_all_dim)
        }
    args = PrimusDeepSeekV3Args(
        max_seq_len=seq_len,
        vocab_size=m.vocab_size,
        dim=m.hidden_size,
        inter_dim=m.ffn_hidden_size,
        moe_inter_dim=e.expert_ffn_hidden_size,
        n_layers=m.num_layers,
        n_dense_layers=e.first_dense_layers,
        n_heads=m.num_attention_heads,
        norm_eps=m.norm_eps,
        moe_args=MoEArgs(
            num_experts=e.num_experts,
            num_shared_experts=e.shared_experts,
            score_func=e.router,
            route_norm=e.normalize_topk,
            route_scale=e.scaling_factor,
            score_before_experts=False,
            top_k=e.experts_per_token,
            num_expert_groups=e.expert_groups if e.expert_groups > 1 else None,
            num_limited_groups=e.groups_per_token if e.expert_groups > 1 else None,
            use_grouped_mm=torch.cuda.is_available(),
            # the routing bias is part of every DeepSeek model (its HF folders hold it); balancing none: frozen
            load_balance_coeff=1e-3,
        ),
        q_lora_rank=a.q_lora_rank or 0,
        kv_lora_rank=a.kv_lora_rank,
        qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
        attn_type="sdpa",
        rope_theta=m.rope_theta,
        freeze_expert_bias=e.balancing != "loss_free",
        **yarn,
    )
    args.max_seq_len = args.yarn_seq_len(seq_len)
    args.moe_impl = "standard"  # what update_from_config sets in a run (torchtitan's all-to-all expert dispatch)
    return args


def train_spec() -> Any:
    """torchtitan's deepseek_v3 TrainSpec with :class:`PrimusDeepSeekV3Model`."""
    from torchtitan.protocols.train_spec import get_train_spec

    return dataclasses.replace(get_train_spec("deepseek_v3"), model_cls=PrimusDeepSeekV3Model)
