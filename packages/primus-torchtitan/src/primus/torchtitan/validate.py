"""What the torchtitan backend refuses, before any work, each with the reason and what would work.

This module imports neither torch nor torchtitan (``primus config validate`` stays fast). What it knows of
torchtitan's JobConfig (its sections, the schedule names, how ``backend.extra`` names a field) comes from
:mod:`primus.torchtitan.job_config`, the mapping a run builds its JobConfig with.
"""

from __future__ import annotations

from typing import Any

from primus.core.config import gpt_oss
from primus.core.config.schema import PrimusConfig
from primus.core.contracts.protocols import ConfigIssue
from primus.torchtitan import faults, fp8
from primus.torchtitan.job_config import JOB_CONFIG_SECTIONS, PP_SCHEDULES, extra_value

FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "deepseek"})

# torchtitan 0.2.2 has a gpt_oss model (sinks, sliding window, YaRN, clamped SwiGLU, expert biases; FlexAttention)
GPT_OSS_LACKS = (
    "Primus's torchtitan adapter does not build torchtitan 0.2.2's gpt_oss model (attention sinks, sliding window, "
    "YaRN; FlexAttention only)"
)


def _model_issues(cfg: PrimusConfig) -> list[ConfigIssue]:
    m, out = cfg.model, []
    if m.family in ("llama", "mistral", "qwen2"):  # torchtitan's llama3 model, or Primus's dense one
        if m.head_dim is not None and m.head_dim * m.num_attention_heads != m.hidden_size:
            out.append(
                ConfigIssue(
                    "model.head_dim",
                    f"torchtitan's llama3 attention uses hidden_size / heads = "
                    f"{m.hidden_size // m.num_attention_heads}",
                    value=m.head_dim,
                    allowed=f"null or {m.hidden_size // m.num_attention_heads}",
                )
            )
        if m.qk_norm:
            out.append(
                ConfigIssue(
                    "model.qk_norm",
                    f"torchtitan's llama3 model has no qk_norm ({m.family})",
                    value=True,
                    allowed="false, or model.family: qwen3",
                )
            )
        if m.rope_scaling is not None and m.rope_scaling.type != "llama3":
            out.append(
                ConfigIssue(
                    "model.rope_scaling.type",
                    "torchtitan's llama3 model implements only llama3 RoPE scaling",
                    value=m.rope_scaling.type,
                    allowed="llama3",
                )
            )
    if m.family == "qwen3":
        if m.qkv_bias:
            out.append(
                ConfigIssue("model.qkv_bias", "torchtitan's qwen3 model has no qkv bias", value=True, allowed="false")
            )
        if m.rope_scaling is not None:
            out.append(
                ConfigIssue("model.rope_scaling", "torchtitan's qwen3 model has no RoPE scaling", allowed="null")
            )
    return out


def _parallel_issues(cfg: PrimusConfig, world_size: int) -> list[ConfigIssue]:
    p, t, m, out = cfg.parallel, cfg.train, cfg.model, []
    dp_shard = p.shard_size(world_size)
    if p.pp > 1:
        if m.tie_word_embeddings:
            out.append(
                ConfigIssue(
                    "parallel.pp",
                    "a tied embedding and output head would sit on the first and last pipeline stages",
                    value=p.pp,
                    allowed="1, or model.tie_word_embeddings: false",
                )
            )
        if p.pp_schedule == "zero_bubble" and p.vpp < 2:
            out.append(
                ConfigIssue(
                    "parallel.pp_schedule",
                    f"torchtitan's zero-bubble schedule ({PP_SCHEDULES['zero_bubble']}) needs several stages per rank",
                    value=p.pp_schedule,
                    allowed="1f1b, gpipe, or parallel.vpp > 1",
                )
            )
        if p.vpp > 1 and p.pp_schedule in ("1f1b", "gpipe"):
            out.append(
                ConfigIssue(
                    "parallel.pp_schedule",
                    f"{p.pp_schedule} runs one stage per rank, but parallel.vpp is {p.vpp}",
                    value=p.pp_schedule,
                    allowed="interleaved_1f1b or zero_bubble",
                )
            )
    if m.moe is not None:
        out += _moe_issues(cfg)
    out += _deepseek_issues(cfg)
    if p.distributed_optimizer:
        out.append(
            ConfigIssue(
                "parallel.distributed_optimizer",
                "torchtitan has no distributed optimizer (Megatron's ZeRO-1); it shards optimizer state with FSDP",
                value=True,
                allowed="false, with parallel.dp_shard > 1 (or parallel.strategy: fsdp2) to shard the state",
            )
        )
    if p.fsdp is False and dp_shard > 1:
        out.append(
            ConfigIssue(
                "parallel.fsdp",
                "torchtitan shards data parallelism only with FSDP2 (no optimizer-only sharding)",
                value=False,
                allowed="true or auto with parallel.dp_shard > 1, or parallel.dp_shard: 1",
            )
        )
    if p.dp_replicate > 1 and dp_shard == 1 and (p.tp > 1 or p.pp > 1 or p.cp > 1):
        out.append(
            ConfigIssue(
                "parallel.dp_replicate",
                "torchtitan's DDP (replicate without sharding) cannot be combined with tp, pp or cp",
                value=p.dp_replicate,
                allowed="dp_shard > 1 (HSDP), or tp = pp = cp = 1",
            )
        )
    if t.precision == "bf16" and dp_shard == 1 and p.dp_replicate == 1 and (p.tp > 1 or p.pp > 1):
        out.append(
            ConfigIssue(
                "train.precision",
                "torchtitan 0.2.2 applies bf16 mixed precision through FSDP, or "
                "autocast without tp/pp; with tp or pp and no FSDP it would silently train in fp32",
                value=t.precision,
                allowed="fp32, or parallel.dp_shard > 1",
            )
        )
    if p.recompute == "full" and p.recompute_layers is not None:
        out.append(
            ConfigIssue(
                "parallel.recompute_layers",
                "torchtitan's full activation checkpointing wraps every "
                "layer; to checkpoint every N-th layer use parallel.recompute: selective with "
                "backend.extra.activation_checkpoint.selective_ac_option: N",
                value=p.recompute_layers,
                allowed="null",
            )
        )
    if m.family == "qwen3" and m.tie_word_embeddings and dp_shard > 1:
        out.append(
            ConfigIssue(
                "model.tie_word_embeddings",
                "torchtitan 0.2.2's qwen3 FSDP puts the tied embedding "
                "and output head in two FSDP groups, which torch refuses",
                value=True,
                allowed="false, or parallel.dp_shard: 1",
            )
        )
    return out


def _deepseek_issues(cfg: PrimusConfig) -> list[ConfigIssue]:
    """What torchtitan 0.2.2's deepseek_v3 model (:mod:`primus.torchtitan.deepseek`) does not cover."""
    m, out = cfg.model, []
    if m.family == "deepseek" and m.moe is None:
        why = "torchtitan's deepseek_v3 model makes every layer after the first dense ones a mixture-of-experts layer"
        out.append(ConfigIssue("model.moe", why, value=None, allowed="a mixture-of-experts section"))
    if m.mtp is not None:
        why = (
            "torchtitan 0.2.2's deepseek_v3 model has no multi-token prediction (megatron trains it; model.mtp: null "
            "trains without, a folder's multi-token-prediction weights left unread)"
        )
        out.append(ConfigIssue("model.mtp", why, value=m.mtp.layers, allowed="null"))
    rs = m.rope_scaling
    if m.family == "deepseek" and rs is not None and rs.mscale != rs.mscale_all_dim:
        why = "torchtitan's YaRN scales the softmax only (no attention factor on the rotary dims): mscale must equal it"
        out.append(ConfigIssue("model.rope_scaling.mscale", why, value=rs.mscale, allowed=str(rs.mscale_all_dim)))
    return out


def _moe_issues(cfg: PrimusConfig) -> list[ConfigIssue]:
    """What torchtitan 0.2.2's MoE (in its qwen3 model: every layer, no token dropping) and this backend's wiring of
    it do not cover. Auxiliary-loss balancing (``balancing: aux_loss``, ``seq_aux_loss_coeff``) is Primus's, on its
    routers (:mod:`primus.torchtitan.balancing`), in every layout."""
    m, p, e = cfg.model, cfg.parallel, cfg.model.moe
    out: list[ConfigIssue] = []
    if m.family not in ("qwen3", "deepseek"):
        why = "torchtitan 0.2.2 builds mixture-of-experts layers in its qwen3 and deepseek_v3 models"
        out.append(ConfigIssue("model.family", why, value=m.family, allowed="qwen3, deepseek"))
    if m.family == "deepseek" and e.layer_frequency != 1:
        why = "torchtitan's deepseek_v3 model makes every layer after the first dense ones a mixture-of-experts layer"
        out.append(ConfigIssue("model.moe.layer_frequency", why, value=e.layer_frequency, allowed="1"))
    if m.family == "qwen3" and (e.first_dense_layers or e.layer_frequency != 1):
        key = "model.moe.first_dense_layers" if e.first_dense_layers else "model.moe.layer_frequency"
        value = e.first_dense_layers or e.layer_frequency
        why = "torchtitan's qwen3 model makes every layer a mixture-of-experts layer"
        out.append(ConfigIssue(key, why, value=value, allowed="0" if e.first_dense_layers else "1"))
    if e.capacity_factor is not None:
        why = "torchtitan 0.2.2's MoE drops no tokens (no expert capacity)"
        out.append(ConfigIssue("model.moe.capacity_factor", why, value=e.capacity_factor, allowed="null"))
    etp = extra_value(cfg.backend.extra, "parallelism.expert_tensor_parallel_degree")
    if etp not in (None, p.tp):
        why = (
            "the experts are tensor-parallel as the dense layers; torchtitan 0.2.2's other layout (ETP 1: the TP "
            "ranks lent to EP) leaves the MoE input's gradient unreduced (torchtitan#2387)"
        )
        key = "backend.extra.parallelism.expert_tensor_parallel_degree"
        out.append(ConfigIssue(key, why, value=etp, allowed=f"{p.tp} (parallel.tp)"))
    return out


def _train_issues(cfg: PrimusConfig) -> list[ConfigIssue]:
    t, out = cfg.train, []
    if t.precision == "fp16":
        out.append(
            ConfigIssue(
                "train.precision", "torchtitan 0.2.2 has no fp16 loss scaling", value="fp16", allowed="bf16, fp32"
            )
        )
    if t.optimizer.name == "sgd":
        out.append(
            ConfigIssue(
                "train.optimizer.name",
                "torchtitan 0.2.2 builds Adam and AdamW only",
                value="sgd",
                allowed="adamw, adam",
            )
        )
    if cfg.checkpoint.keep_last == 1:
        out.append(
            ConfigIssue(
                "checkpoint.keep_last",
                "torchtitan keeps at least 2 checkpoints (the newest may still be being written)",
                value=1,
                allowed="2 or more",
            )
        )
    return out


def _lora_issues(cfg: PrimusConfig) -> list[ConfigIssue]:
    """``train.lora`` hooks its adapters on torchtitan's linears (:mod:`primus.torchtitan.lora`); FP8 swaps them."""
    if cfg.train.lora is None or cfg.kernels.fp8 == "off":
        return []
    why = "train.lora's adapters hook torchtitan's linears, and FP8 replaces them (no FP8 frozen base is built yet)"
    return [ConfigIssue("kernels.fp8", why, value=cfg.kernels.fp8, allowed="off with train.lora")]


# core's plain-PyTorch providers: what torchtitan's own modules compute (they are never swapped in)
REFERENCE_KERNELS = {
    "attention": "sdpa",
    "rms_norm": "torch",
    "swiglu": "torch",
    "cross_entropy": "torch",
    "rope": "torch",
    "grouped_gemm": "torch",
    "moe_permute": "torch",
    "moe_router": "torch",
}


def _dtensor_reason(cfg: PrimusConfig, op: str) -> str:
    """Why ``op`` runs on DTensors (which only torch ops take) in this layout, or "" (mirrors
    :func:`primus.torchtitan.kernels.plan`)."""
    p = cfg.parallel
    loss_parallel = not extra_value(cfg.backend.extra, "parallelism.disable_loss_parallel", False)
    if op == "rms_norm" and p.tp > 1:
        return "torchtitan's tensor parallelism runs the norms on DTensors (sequence parallel)"
    if op == "cross_entropy" and p.tp > 1 and loss_parallel:
        return (
            "torchtitan's loss parallelism runs the loss on DTensors "
            "(backend.extra.parallelism.disable_loss_parallel: true gathers the logits instead)"
        )
    if op == "attention" and p.tp > 1 and p.cp > 1 and cfg.model.family == "qwen3":
        return "torchtitan's qwen3 attention runs on DTensors under tensor × context parallelism"
    return ""


def _kernel_issues(cfg: PrimusConfig) -> list[ConfigIssue]:
    from primus.core.contracts.plugins import get_registry
    from primus.core.kernels.selection import cp_attention_issues

    out = []
    for op, ref in REFERENCE_KERNELS.items():
        choice = getattr(cfg.kernels, op)
        # under context parallelism torchtitan's own module runs under torch's context-parallel SDPA (GPU only)
        if op == "attention" and cfg.parallel.cp > 1 and (issues := cp_attention_issues(cfg, get_registry(), ref)):
            out.extend(issues)
            continue
        if choice in ("auto", ref):
            continue  # auto: a provider the layout cannot take is left out at run time, with the reason logged
        if op == "rope":
            why = (
                "torchtitan's qwen3 RoPE (rotate-half) is inline in its Attention.forward, not a module to swap"
                if cfg.model.family == "qwen3"
                else "torchtitan's llama3 RoPE rotates interleaved pairs (complex freqs_cis); "
                "the rope provider contract is rotate-half"
            )
            out.append(ConfigIssue("kernels.rope", why, value=choice, allowed=f"auto, {ref}"))
            continue
        reason = _dtensor_reason(cfg, op)
        if reason:
            out.append(
                ConfigIssue(
                    f"kernels.{op}",
                    f"{reason}; provider {choice!r} takes plain tensors",
                    value=choice,
                    allowed=f"auto, {ref}",
                )
            )
    return out


# torchtitan fields Primus depends on: field -> (the one value allowed, why)
PINNED_EXTRA = {
    "parallelism.context_parallel_load_balancer": (
        "headtail",
        "Primus's context-parallel attention and RoPE expect torch's head-tail shards (chunks r and 2·cp-1-r)",
    ),
    "checkpoint.async_mode": (
        "disabled",
        "Primus commits a checkpoint (manifest, rename) once its save is on disk: saves must be synchronous",
    ),
}


# torchtitan fields whose job is core's, one key on every engine: field -> the core key
CORE_KEYS = {
    "checkpoint.initial_load_path": "train.init_from",
    "checkpoint.initial_load_in_hf": "train.init_from (a Hugging Face folder)",
    "checkpoint.initial_load_model_only": "train.init_from (it takes the model weights alone)",
    "checkpoint.create_seed_checkpoint": "train.save_initial (then train.init_from on any layout)",
}


def _extra_issues(extra: dict[str, Any]) -> list[ConfigIssue]:
    out = [
        ConfigIssue(
            f"backend.extra.{key}",
            "a run's initial weights are core's, the same key on every engine",
            value=value,
            allowed=core_key,
        )
        for key, core_key in CORE_KEYS.items()
        if (value := extra_value(extra, key)) is not None
    ]
    for key, value in extra.items():
        section = key.split(".")[0]
        if key == faults.EXTRA_KEY:  # Primus's test-only fault injectors, not a JobConfig section
            out += [
                ConfigIssue(f"backend.extra.{key}", problem, allowed=", ".join(faults.KEYS))
                for problem in faults.issues(extra)
            ]
        elif section == "lr_scheduler":  # torchtitan's schedulers never step: core's loop sets the lr
            out.append(
                ConfigIssue(
                    f"backend.extra.{key}",
                    "the learning-rate schedule is core's, the same on every engine",
                    value=value,
                    allowed="train.schedule.warmup_steps, train.schedule.decay, train.schedule.decay_steps, "
                    "train.optimizer.lr / min_lr",
                )
            )
        elif section not in JOB_CONFIG_SECTIONS:
            out.append(
                ConfigIssue(
                    f"backend.extra.{key}",
                    "not a section of torchtitan's JobConfig",
                    allowed=", ".join(sorted(JOB_CONFIG_SECTIONS)),
                )
            )
        elif "." not in key and not isinstance(value, dict):
            out.append(
                ConfigIssue(f"backend.extra.{key}", "must be a mapping of torchtitan config fields", value=value)
            )
    for key, (allowed, why) in PINNED_EXTRA.items():
        if (value := extra_value(extra, key)) not in (None, allowed):
            out.append(ConfigIssue(f"backend.extra.{key}", why, value=value, allowed=allowed))
    return out


def cpu_refusal(cfg: PrimusConfig, cp_attention: bool = False) -> str | None:
    """What cannot run on a CPU (gloo) with torch 2.13, though it runs on GPUs: torch registers no DTensor
    sharding rule for the CPU flash-attention op that SDPA picks, which torch's own context parallelism reaches (and
    qwen3's attention under TP × CP, on DTensors; under TP alone the provider runs on each rank's heads).
    ``cp_attention``: the attention provider has a context-parallel entry point (primus-turbo's ring attention),
    which runs on local shards instead. Asked by the engine adapter, which knows the device and the provider."""
    p = cfg.parallel
    if cfg.model.family == "qwen3" and p.tp > 1 and p.cp > 1:
        return "qwen3 with parallel.tp > 1 and parallel.cp > 1 needs a GPU: no DTensor rule for CPU flash attention"
    if p.cp > 1 and not cp_attention:
        return (
            "parallel.cp > 1 with torch's own context-parallel attention needs a GPU (no DTensor sharding rule for "
            "CPU flash attention): install primus-turbo for its ring attention (kernels.attention: ring or auto)"
        )
    return None


def validate(cfg: PrimusConfig, world_size: int = 1) -> list[ConfigIssue]:
    """Everything torchtitan 0.2.2 cannot run for this config (empty if it can)."""
    if cfg.model.family == gpt_oss.FAMILY:  # one refusal, what is missing: the rest would be about a model not built
        return [gpt_oss.refusal("torchtitan", GPT_OSS_LACKS, FAMILIES)]
    return [
        *gpt_oss.part_issues(cfg.model, "torchtitan"),
        *_model_issues(cfg),
        *_parallel_issues(cfg, world_size),
        *_train_issues(cfg),
        *_lora_issues(cfg),
        *_kernel_issues(cfg),
        *fp8.issues(cfg),
        *_extra_issues(cfg.backend.extra),
    ]
