"""What the megatron backend refuses, with the reason, before any device work (no megatron import)."""

from __future__ import annotations

from primus.core.config import gpt_oss
from primus.core.config.schema import PrimusConfig
from primus.core.contracts.protocols import ConfigIssue
from primus.megatron import deepseek, faults, fp8

# backend.extra keys: a seed checkpoint (same initial weights in every layout), raw
# TransformerConfig / DistributedDataParallelConfig fields passed through unchanged, and the
# test-only fault injectors (primus.megatron.faults).
EXTRA_KEYS = frozenset({"transformer_config", "ddp", "fault_injection"})

FAMILIES = frozenset({"llama", "qwen2", "qwen3", "mistral", "deepseek"})

# what Primus's local layer spec (primus.megatron.layer_spec) lacks of GPT-OSS's parts
GPT_OSS_LACKS = (
    "its local layer spec (primus.megatron.layer_spec) has no attention sinks and no sliding-window attention "
    "(nor GPT-OSS's clamped SwiGLU with expert biases)"
)


def validate(cfg: PrimusConfig, world_size: int = 1) -> list[ConfigIssue]:
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if m.family == gpt_oss.FAMILY:  # one refusal, what is missing: the rest would be about a model it cannot build
        return [gpt_oss.refusal("megatron", GPT_OSS_LACKS, FAMILIES)]
    out: list[ConfigIssue] = gpt_oss.part_issues(m, "megatron")

    def refuse(path: str, message: str, value: object = None, allowed: str | None = None) -> None:
        out.append(ConfigIssue(path, message, value, allowed))

    # Context parallelism: megatron-core 0.16 implements it only inside TEDotProductAttention (Transformer Engine);
    # here the attention provider's context-parallel entry point does (kernel selection refuses a provider without
    # it), over megatron's 2 × cp chunks of the sequence (core checks that seq_len splits into them)
    if p.cp > 1:
        from primus.core.contracts.plugins import get_registry
        from primus.core.kernels.selection import cp_attention_issues

        out.extend(cp_attention_issues(cfg, get_registry()))
    if p.cp > 1 and p.fsdp is True:
        refuse(
            "parallel.cp",
            "FSDP2 with context parallelism is not wired on this backend (its checkpoint "
            "layout shards over data-parallel ranks only)",
            p.cp,
            "1 with parallel.fsdp: true",
        )
    if m.moe is not None:
        out.extend(_moe_issues(cfg))
    if p.pp_schedule in ("gpipe", "zero_bubble"):
        refuse(
            "parallel.pp_schedule",
            f"megatron-core 0.16 has no {p.pp_schedule} schedule",
            p.pp_schedule,
            "1f1b, interleaved_1f1b",
        )
    if p.vpp > 1 and p.pp_schedule != "interleaved_1f1b":
        refuse(
            "parallel.pp_schedule",
            "with parallel.vpp > 1 megatron-core runs the interleaved 1F1B schedule",
            p.pp_schedule,
            "interleaved_1f1b",
        )
    if p.pp == 2 and p.vpp > 1 and cfg.backend.extra.get("transformer_config", {}).get("batch_p2p_comm"):
        refuse(
            "backend.extra.transformer_config.batch_p2p_comm",
            "batched p2p with pp = 2 and the interleaved schedule swaps activations and gradients between the two "
            "stages (megatron-core posts a peer's sends and receives in different orders; see model.pipeline_p2p)",
            True,
            "false",
        )
    if m.num_layers % (p.pp * p.vpp):
        refuse(
            "model.num_layers",
            f"{m.num_layers} layers do not split evenly over pp × vpp = {p.pp * p.vpp} model chunks",
            m.num_layers,
            f"a multiple of {p.pp * p.vpp}",
        )
    if p.sequence_parallel and t.seq_len % p.tp:
        refuse(
            "train.seq_len",
            f"sequence parallel splits the sequence over tp = {p.tp}",
            t.seq_len,
            f"a multiple of {p.tp}",
        )
    # Data parallelism is dp_replicate × dp_shard ranks; dp_shard > 1 shards the optimizer state over
    # each group of dp_shard ranks (megatron's distributed optimizer, ZeRO-1; with dp_replicate > 1 one
    # optimizer instance per replica), parameters and gradients replicated; with parallel.fsdp: true, FSDP2
    # shards all three (primus.megatron.fsdp).
    shard = p.shard_size(world_size)
    if "fsdp" in cfg.backend.extra:
        refuse(
            "backend.extra.fsdp",
            "megatron-core 0.16.1's own FullyShardedDataParallel is not offered by primus-megatron: with one rank in "
            "its group it adds each micro-batch's reduced gradient back onto itself (2^M too large after M "
            "micro-batches: the 8.8× grad norm seen on an H200; Megatron-LM issue 6660, fixed upstream after 0.16; "
            "benchmarks/results/megatron_fsdp_gradnorm.json). PyTorch FSDP2 under megatron is offered",
            cfg.backend.extra["fsdp"],
            "parallel.fsdp: true with parallel.dp_shard > 1",
        )
    if p.fsdp is True and shard > 1:
        out.extend(_fsdp_issues(cfg, shard))
    elif p.overlap_param_gather and not (p.distributed_optimizer or shard > 1):
        refuse(
            "parallel.overlap_param_gather",
            "needs parallel.distributed_optimizer: true (parameters are "
            "all-gathered only when the optimizer is sharded)",
            True,
        )
    if p.recompute == "full" and p.recompute_layers is not None:
        per_stage = m.num_layers // (p.pp * p.vpp)
        if p.recompute_method == "block" and p.recompute_layers > per_stage:
            refuse(
                "parallel.recompute_layers",
                f"block recompute of {p.recompute_layers} layers exceeds the {per_stage} layers of a model chunk",
                p.recompute_layers,
                f"1..{per_stage}",
            )
        if p.recompute_method == "uniform" and per_stage % p.recompute_layers:
            refuse(
                "parallel.recompute_layers",
                f"uniform recompute groups of {p.recompute_layers} layers do not "
                f"divide the {per_stage} layers of a model chunk",
                p.recompute_layers,
            )
    if t.precision == "fp16":
        refuse("train.precision", "fp16 needs loss scaling, which this backend does not set up", "fp16", "bf16, fp32")
    if t.compile:
        refuse(
            "train.compile", "torch.compile of megatron-core modules is not supported by this backend", True, "false"
        )
    if m.rope_scaling is not None and m.rope_scaling.type == "yarn" and m.mla is None:  # MLA: its own YaRN
        refuse(
            "model.rope_scaling.type",
            "YaRN scaling is not wired to megatron's YarnRotaryEmbedding here",
            "yarn",
            "llama3, linear",
        )
    if cfg.data.format == "megatron" and cfg.data.source in ("bundled", "mock"):
        refuse("data.source", "data.format: megatron reads .bin/.idx prefixes; give a path", cfg.data.source)
    out.extend(fp8.issues(cfg))
    out.extend(deepseek.issues(cfg))
    for problem in faults.issues(cfg.backend.extra):
        refuse("backend.extra.fault_injection", problem, allowed=", ".join(faults.KEYS))
    if "seed_checkpoint" in cfg.backend.extra:  # (its key before core had one for every engine)
        refuse(
            "backend.extra.seed_checkpoint",
            "a run's initial weights are core's, the same key on every engine",
            cfg.backend.extra["seed_checkpoint"],
            "train.save_initial (write them), train.init_from (load them, any layout)",
        )
    unknown = set(cfg.backend.extra) - EXTRA_KEYS - {"fsdp", "seed_checkpoint"}  # refused above with their reasons
    if unknown:
        refuse(
            "backend.extra",
            f"unknown keys for the megatron backend: {', '.join(sorted(unknown))}",
            allowed=", ".join(sorted(EXTRA_KEYS)),
        )
    return out


def _fsdp_issues(cfg: PrimusConfig, dp: int) -> list[ConfigIssue]:
    """What FSDP2 under megatron-core 0.16 (TorchFullyShardedDataParallel) cannot run, and the checkpoint layout of
    its shards (primus.megatron.checkpoint): every sharded weight's rows split evenly over the dp ranks."""
    m, p = cfg.model, cfg.parallel
    out: list[ConfigIssue] = []
    if p.dp_replicate > 1:
        out.append(
            ConfigIssue(
                "parallel.dp_replicate",
                "megatron-core 0.16's FSDP2 wrapper shards over the whole data-parallel group: no replicas (HSDP)",
                p.dp_replicate,
                "1 with parallel.fsdp: true",
            )
        )
    if p.overlap_param_gather:
        out.append(
            ConfigIssue(
                "parallel.overlap_param_gather",
                "belongs to the distributed optimizer; FSDP2 prefetches the next layer's parameters itself",
                True,
                "false with parallel.fsdp: true",
            )
        )
    if cfg.kernels.fp8 != "off":
        out.append(
            ConfigIssue(
                "kernels.fp8",
                "FP8 linears on FSDP2-sharded megatron weights are not wired (their scales are per full weight)",
                cfg.kernels.fp8,
                "off with parallel.fsdp: true",
            )
        )
    rows = {
        "model.hidden_size": m.hidden_size,
        "model.ffn_hidden_size (SwiGLU: 2 × ffn / tp)": 2 * m.ffn_hidden_size // p.tp,
        "model.num_attention_heads (q, k, v rows / tp)": (m.num_attention_heads + 2 * m.num_kv_heads)
        * m.kv_channels
        // p.tp,
    }
    if dp % 2:
        out.append(
            ConfigIssue(
                "parallel.dp_shard",
                "FSDP2 on megatron needs an even dp_shard: a rank's rows of the SwiGLU weight must lie in one of its "
                "two halves for the checkpoint to place them",
                dp,
                "an even number",
            )
        )
    for path, n in rows.items():
        if n % dp:
            out.append(
                ConfigIssue(
                    path.split(" ")[0],
                    f"FSDP2 splits each weight's {n} rows ({path}) over dp_shard = {dp} ranks; megatron's checkpoint "
                    "needs equal shards",
                    n,
                    f"a size whose rows divide by {dp}",
                )
            )
    return out


# MoE kernel ops megatron-core runs itself, each with why a provider's cannot take its place
MEGATRON_MOE_OPS = {
    "moe_permute": "megatron-core's token dispatcher permutes the tokens itself (moe_utils.permute / unpermute)",
    "moe_router": "megatron-core's TopKRouter scores and chooses the experts itself (its aux losses hook into it)",
}


def _moe_issues(cfg: PrimusConfig) -> list[ConfigIssue]:
    """What this backend's mixture-of-experts model (megatron-core's MoE layer: router, all-to-all dispatch over
    parallel.ep, experts as grouped GEMMs or a loop of local MLPs) does not cover yet."""
    p = cfg.parallel
    out: list[ConfigIssue] = []
    if p.fsdp is True and p.shard_size(1) > 1:
        why = (
            "FSDP2 of expert weights is not wired: measured, FSDP2 at ep 1 trains one rank's MoE curve but its "
            "checkpoint fails (stacked experts: no sharded tensor matches the FSDP2 parameter; megatron's per-expert "
            "SequentialMLP: the save hangs), and ep > 1 needs the experts sharded over their own data-parallel group, "
            "which megatron-core 0.16's TorchFullyShardedDataParallel does not do; the distributed optimizer "
            "(parallel.fsdp: false) shards the experts' optimizer state"
        )
        out.append(ConfigIssue("parallel.fsdp", why, True, "false or auto"))
    if cfg.kernels.fp8 != "off" and cfg.kernels.grouped_gemm == "torch":
        why = f"{fp8.FP8_EXPERTS_NEED}; kernels.grouped_gemm: torch gives megatron's per-expert SequentialMLP"
        out.append(ConfigIssue("kernels.grouped_gemm", why, "torch", "auto or a grouped provider (grouped_mm)"))
    for op, why in MEGATRON_MOE_OPS.items():
        if (choice := getattr(cfg.kernels, op)) not in ("auto", "torch"):
            out.append(ConfigIssue(f"kernels.{op}", why, choice, "auto, torch"))
    e = cfg.model.moe
    if e is not None and e.balancing == "loss_free" and e.router != "sigmoid":
        why = "megatron-core 0.16's loss-free balancing (router expert bias) takes a sigmoid router only"
        out.append(ConfigIssue("model.moe.balancing", why, "loss_free", "aux_loss, none, or model.moe.router: sigmoid"))
    tp = cfg.parallel.tp
    if e is not None and tp > 1 and not cfg.parallel.sequence_parallel:  # else a ValueError inside megatron
        why = (
            "megatron-core 0.16 runs mixture-of-experts layers under tensor parallelism only with sequence parallelism"
        )
        out.append(ConfigIssue("parallel.sequence_parallel", why, False, "true, or parallel.tp: 1"))
    if e is not None and e.seq_aux_loss_coeff > 0 and (tp > 1 or cfg.parallel.cp > 1):
        why = (
            "megatron-core 0.16's sequence-wise auxiliary loss on a sequence split over ranks (TP + SP, CP) trains "
            "another curve than one rank (measured on tiny-qwen3-moe, coefficient 1e-2: TP 2 + SP x EP 2 and CP 2 x EP 2 "
            "5e-5 relative apart at step 4); EP 2 and EP 4 equal one rank"
        )
        out.append(
            ConfigIssue("model.moe.seq_aux_loss_coeff", why, e.seq_aux_loss_coeff, "0, or parallel.tp and cp: 1")
        )
    return out
