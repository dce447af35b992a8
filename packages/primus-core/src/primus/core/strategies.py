"""Built-in parallel strategies: how each fills the parallel section, and a first-order memory model.

The memory model (bytes per device, mixed precision with fp32 master weights and Adam):
  parameters   = P / (tp·pp) × 2 (bf16 compute copy)          ÷ dp when sharded (FSDP)
  gradients    = P / (tp·pp) × 4 (fp32 grads / main_grad)      ÷ dp when sharded (FSDP)
  optimizer    = P / (tp·pp) × 12 (fp32 master + Adam m, v)    ÷ dp with a distributed optimizer or FSDP
  activations  = per layer s·b·d·(34 + 5·h·s/d) bytes (Korthikanti et al. 2022, bf16, no recompute),
                 ÷ tp with sequence parallel, × layers per stage, × in-flight micro-batches under PP;
                 selective recompute drops the 5·h·s/d term; full keeps only 2·s·b·d per layer.
The planner (``primus plan``) refines this per engine; these are the defaults strategies start from.
"""

from __future__ import annotations

from typing import Any

from primus.core.config.schema import PrimusConfig
from primus.core.modelmath import count_params
from primus.core.protocols import MemoryEstimate, StrategySpec


def _rest(parallel: dict[str, Any], world_size: int, *used: str) -> int:
    fixed = 1
    for key in used:
        fixed *= int(parallel.get(key, 1))
    return max(world_size // fixed, 1)


def fill_ddp(parallel: dict[str, Any], world_size: int, cfg: PrimusConfig | None = None) -> dict[str, Any]:
    out = dict(parallel, dp_shard=1)
    out["dp_replicate"] = _rest(out, world_size, "tp", "pp", "cp")
    out["distributed_optimizer"] = True  # explicit settings are kept by the caller
    return out


def fill_fsdp2(parallel: dict[str, Any], world_size: int, cfg: PrimusConfig | None = None) -> dict[str, Any]:
    out = dict(parallel, dp_replicate=1)
    out["dp_shard"] = _rest(out, world_size, "tp", "pp", "cp")
    return out


def fill_tp_pp_vpp(parallel: dict[str, Any], world_size: int, cfg: PrimusConfig | None = None) -> dict[str, Any]:
    out = dict(parallel)
    if out.get("tp", 1) == 1:
        out["tp"] = min(8, world_size)
    out["sequence_parallel"] = out["tp"] > 1
    out["dp_shard"] = 1
    out["dp_replicate"] = _rest(out, world_size, "tp", "pp", "cp")
    out["distributed_optimizer"] = True  # explicit settings are kept by the caller
    return out


def estimate_memory(cfg: PrimusConfig, world_size: int) -> MemoryEstimate:
    m, t, p = cfg.model, cfg.train, cfg.parallel
    n = count_params(m).total / (p.tp * p.pp)
    dp_shard = (
        p.dp_shard if isinstance(p.dp_shard, int) else max(world_size // (p.dp_replicate * p.tp * p.pp * p.cp), 1)
    )
    dp = p.dp_replicate * dp_shard
    fsdp = dp_shard > 1
    s, b, d, h = t.seq_len // p.cp, t.micro_batch_size, m.hidden_size, m.num_attention_heads
    per_layer = {"none": s * b * d * (34 + 5 * h * s / d), "selective": s * b * d * 34, "full": 2 * s * b * d}[
        p.recompute
    ]
    if p.sequence_parallel or p.recompute != "full":
        per_layer /= p.tp
    in_flight = p.pp if p.pp > 1 else 1
    return MemoryEstimate(
        {
            "parameters": n * 2 / (dp_shard if fsdp else 1),
            "gradients": n * 4 / (dp_shard if fsdp else 1),
            "optimizer": n * 12 / (dp if (p.distributed_optimizer or fsdp) else 1),
            "activations": per_layer * m.num_layers / p.pp * in_flight,
            "logits": s * b * m.vocab_size * 4 / p.tp,
        }
    )


BUILTIN_STRATEGIES = [
    StrategySpec(
        "ddp", "data parallel, replicated weights; distributed optimizer shards Adam state", fill_ddp, estimate_memory
    ),
    StrategySpec(
        "fsdp2", "fully sharded data parallel (params, grads, optimizer sharded)", fill_fsdp2, estimate_memory
    ),
    StrategySpec(
        "tp_pp_vpp",
        "tensor + sequence parallel within a node, pipeline (+ virtual stages) across",
        fill_tp_pp_vpp,
        estimate_memory,
    ),
]
