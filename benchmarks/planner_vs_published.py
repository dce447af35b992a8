"""The planner's step-time model against public training results: predicted vs published tokens/s per GPU.

    python3 benchmarks/planner_vs_published.py --out benchmarks/results/planner_vs_published.json

No GPU: each row is a published run (or one of ours, ``ours``: one H200, benchmarks/results/turbo_e2e_s7_*.json,
the ``tt_core`` / ``mg_core`` cases) (its source and the lines it was read from below), planned for exactly its
layout by ``primus.core.planner.search.evaluate`` (the model ``primus plan`` ranks with), on the planner's device
of that name. Sources (read 2026-12-03):

- ``tt``: pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (torchtitan 9dec370, 2024-12) and
  ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``: Grand Teton H100s, 96 GB HBM2e at the default **500 W**
  power limit (the planner's H100 is the 700 W SXM part); sequence length and the selective (per-op) recompute from
  the default train configs at those commits (the files do not state them). Table 1: "FSDP | 5,762", "FSDP +
  torch.compile | 6,667", "FSDP + torch.compile + Float8 | 8,532" (8 GPUs, local batch 2); Table 3: 128 GPUs
  5,605 / 6,514 / 8,380; Table 4: 70B, FSDP 32 × TP 8, local batch 16, full AC, compile, Float8: 829; async-TP
  file: 70B bf16 vanilla TP 597.3, 8B on 64 GPUs FSDP 8 × TP 8 local batch 12 bf16 vanilla TP 4378.
- ``mb``: NVIDIA-NeMo/Megatron-Bridge ``docs/performance-summary-archive.md``, 25.11 DGX-H100 (FP8 current
  scaling; Transformer Engine): "LLAMA3_8B | 8 | FP8-CS | 128 | 1 | 8192 | 8 | 1 | 1 | 1 | n/a | 1 | 16 | 14451",
  "LLAMA3_70B | 64 | FP8-CS | 128 | 1 | 8192 | 0 | 4 | 8 | 1 | 5 | 1 | 64 | 1602", "LLAMA3.1_405B | 1024 | FP8-CS |
  512 | 1 | 8192 | 0 | 8 | 8 | 2 | 8 | 1 | 64 | 292". Recompute is not in the table: none assumed.
- ``amd``: AMD-AGI/Primus ``docs_deprecated/tech_blogs/projection/projection.md`` quoting AMD's ROCm performance
  results page (MI325X, 8 nodes): "Llama 3.1 8B | FP8 | 2 | 8192 | No | 1 | 1 | 1 | 1 | 16,224 | 16,186", "Llama 3.1
  70B | BF16 | 1 | 8192 | Yes | ... | 1,174". Framework, recompute and global batch are not stated: Primus-Megatron,
  no recompute for 8B / full for 70B FSDP at batch 1, one micro-batch per step assumed.

Not found as text (not in the table): MI300X / MI355X absolute results, any H200 result with its layout (TorchTitan's
community H200 entry is FP8 with FP8 all-gather, which the model does not have), BF16 Megatron-Bridge rows.
Transformer Engine's fused kernels are counted as torch.compile's fusion (``KernelTerms.compiled``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from primus.core.contracts.plugins import get_registry
from primus.core.launch.cluster_plan import resolve_on
from primus.core.planner import device
from primus.core.planner.memory import KernelTerms, Layout
from primus.core.planner.search import Cluster, evaluate


@dataclass(frozen=True)
class Published:
    source: str
    preset: str
    device: str
    nodes: int
    engine: str
    dp_mode: str
    dp: int
    micro_batch: int
    micro_batches: int
    recompute: str
    tokens_per_s: float
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    fp8: str = "off"
    compiled: bool = False
    seq: int = 8192
    note: str = ""
    overrides: tuple[str, ...] = ()


UNTIED = ("model.tie_word_embeddings=false",)  # as those runs: torchtitan's llama3 has no tied output head
MOE6 = ("model.num_layers=6", "model.moe.balancing=none")
ROWS = [
    # ours: one H200 at 700 W, torch 2.11: Primus-TorchTitan (compiled) and Primus-Megatron (eager), core's kernels
    Published("ours", "llama3.2-1b", "H200", 1, "torchtitan", "ddp", 1, 1, 1, "none", 48048, compiled=True,
              overrides=UNTIED),
    Published("ours", "llama3.2-1b", "H200", 1, "megatron", "ddp", 1, 1, 1, "none", 41774),
    Published("ours", "llama3.2-3b", "H200", 1, "torchtitan", "ddp", 1, 2, 1, "none", 22518, compiled=True, seq=4096,
              overrides=UNTIED),
    Published("ours", "llama3.2-3b", "H200", 1, "megatron", "ddp", 1, 2, 1, "none", 19569, seq=4096),
    # ours: Qwen3-30B-A3B's shape, 6 of its layers (benchmarks/results/moe_h200_grouped.json tt_core; moe_h200_stacked.json
    # mg_grouped: megatron's experts as stacked parameters)
    Published("ours", "qwen3-30b-a3b", "H200", 1, "torchtitan", "ddp", 1, 1, 1, "none", 26406, seq=4096,
              overrides=MOE6),
    Published("ours", "qwen3-30b-a3b", "H200", 1, "megatron", "ddp", 1, 1, 1, "none", 25762, seq=4096,
              overrides=MOE6),
    # the same at micro-batch 2 (512 tokens per expert; moe_h200_mbs2.json tt_grouped / mg_grouped), and Mixtral's
    # shape, 2 of its layers (moe_h200_mixtral_grouped.json mg_grouped): shapes the MoE terms were not fitted on
    Published("ours", "qwen3-30b-a3b", "H200", 1, "torchtitan", "ddp", 1, 2, 1, "none", 36600, seq=4096,
              overrides=MOE6),
    Published("ours", "qwen3-30b-a3b", "H200", 1, "megatron", "ddp", 1, 2, 1, "none", 40093, seq=4096,
              overrides=MOE6),
    Published("ours", "mixtral-8x7b", "H200", 1, "megatron", "ddp", 1, 1, 1, "none", 38557, seq=4096,
              overrides=("model.num_layers=2", "model.moe.balancing=none")),
    Published("tt T1", "llama3.1-8b", "H100", 1, "torchtitan", "fsdp", 8, 2, 1, "selective", 5762, note="eager"),
    Published("tt T1", "llama3.1-8b", "H100", 1, "torchtitan", "fsdp", 8, 2, 1, "selective", 6667, compiled=True),
    Published("tt T1", "llama3.1-8b", "H100", 1, "torchtitan", "fsdp", 8, 2, 1, "selective", 8532, fp8="tensorwise",
              compiled=True),
    Published("tt T3", "llama3.1-8b", "H100", 16, "torchtitan", "fsdp", 128, 2, 1, "selective", 5605, note="eager"),
    Published("tt T3", "llama3.1-8b", "H100", 16, "torchtitan", "fsdp", 128, 2, 1, "selective", 6514, compiled=True),
    Published("tt aTP", "llama3.1-8b", "H100", 8, "torchtitan", "fsdp", 8, 12, 1, "selective", 4378, tp=8,
              compiled=True, note="vanilla TP"),
    Published("tt aTP", "llama3.1-70b", "H100", 32, "torchtitan", "fsdp", 32, 16, 1, "full", 597.3, tp=8,
              compiled=True, note="vanilla TP"),
    Published("tt T4", "llama3.1-70b", "H100", 32, "torchtitan", "fsdp", 32, 16, 1, "full", 829, tp=8,
              fp8="tensorwise", compiled=True),
    Published("mb 25.11", "llama3.1-8b", "H100", 1, "megatron", "fsdp", 8, 1, 16, "none", 14451, fp8="tensorwise",
              compiled=True),
    Published("mb 25.11", "llama3.1-70b", "H100", 8, "megatron", "ddp_distopt", 2, 1, 64, "none", 1602, tp=4, pp=8,
              vpp=5, fp8="tensorwise", compiled=True),
    Published("mb 25.11", "llama3.1-405b", "H100", 128, "megatron", "ddp_distopt", 8, 1, 64, "none", 292, tp=8, pp=8,
              vpp=8, cp=2, fp8="tensorwise", compiled=True),
    Published("amd", "llama3.1-8b", "MI325X", 8, "megatron", "ddp_distopt", 64, 2, 1, "none", 16186,
              fp8="tensorwise", compiled=True),
    Published("amd", "llama3.1-70b", "MI325X", 8, "megatron", "fsdp", 64, 1, 1, "full", 1174, compiled=True),
]  # fmt: skip


def predict(row: Published, registry) -> dict:
    res, _ = resolve_on(row.preset, [f"train.seq_len={row.seq}", *row.overrides], 8, registry)
    layout = Layout(
        row.engine, row.dp_mode, row.dp, row.tp, row.pp, row.vpp, row.cp, row.recompute,
        micro_batch=row.micro_batch, micro_batches=row.micro_batches,
    )  # fmt: skip
    cluster = Cluster(device(row.device), row.nodes, min(8, layout.world))
    assert layout.world == cluster.world, (row, layout.world, cluster.world)
    global_batch = row.dp * row.micro_batch * row.micro_batches
    kernels = KernelTerms(fp8=row.fp8, compiled=row.compiled)
    cand = evaluate(res.config.model, layout, row.seq, global_batch, cluster, "bf16", kernels)
    t = cand.time
    return {
        **row.__dict__,
        "gpus": cluster.world,
        "layout": layout.describe(),
        "predicted": cand.tokens_per_s_per_device,
        "predicted_over_published": cand.tokens_per_s_per_device / row.tokens_per_s,
        "predicted_mfu": cand.mfu,
        "step_s": {k: getattr(t, k) for k in ("compute", "bubble", "dp_comm", "tp_comm", "pp_comm")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    registry = get_registry()
    rows = [predict(r, registry) for r in ROWS]
    print("| source | model | GPUs | layout | micro-batch × steps | precision | published | predicted | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        prec = ("FP8" if r["fp8"] != "off" else "bf16") + (", compiled/fused" if r["compiled"] else ", eager")
        print(f"| {r['source']} | {r['preset']} | {r['gpus']}× {r['device']} | {r['layout']} | {r['micro_batch']} × "
              f"{r['micro_batches']} | {prec} | {r['tokens_per_s']:,.0f} | {r['predicted']:,.0f} | "
              f"{r['predicted_over_published']:.2f} |")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"argv": sys.argv, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
