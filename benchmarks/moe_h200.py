"""A Qwen3-30B-A3B-shaped MoE model trained on one H200 by both engines, turbo off and on, side by side in one call.

    python3 benchmarks/moe_h200.py --out benchmarks/results/moe_h200.json
    python3 benchmarks/moe_h200.py --out /tmp/smoke.json --smoke        # tiny-qwen3-moe, 4 steps (CPU or GPU)
    python3 benchmarks/moe_h200.py --out P.json --profile --cases mg_turbo,tt_turbo    # + kernel categories
    python3 benchmarks/moe_h200.py --out M.json --preset mixtral-8x7b --layers 2 --cases mg_core,mg_turbo

The model (engine's own initialisation) is the ``qwen3-30b-a3b`` preset (128 experts of width 768, top 8, d 2048, 32 q / 4 kv heads of 128,
vocab 151,936) with ``--layers`` of its 48 layers, so that one GPU holds the weights, gradients and Adam state; no
load balancing (the engines' algorithms differ: the same recipe on both), bf16, random tokens. Cases, each one
``primus train`` process:

- ``mg_core`` / ``mg_turbo``: Primus-Megatron (megatron-core's MoE layer: router, all-to-all dispatcher), core's
  kernel providers pinned (experts: megatron's SequentialMLP, a loop of local MLPs) / ``kernels: auto``
  (primus-turbo: experts as grouped GEMMs, primus.megatron.experts, with the Triton SwiGLU);
- ``mg_grouped``: core's providers but primus-turbo's ``grouped_mm`` for the experts (the grouped GEMMs alone);
- ``tt_core`` / ``tt_turbo``: Primus-TorchTitan (TorchTitan 0.2.2's qwen3 MoE: its own experts, ``torch._grouped_mm``
  / primus-turbo's ``grouped_mm`` provider), the same two kernel settings; ``tt_grouped``: core's providers but
  primus-turbo's ``grouped_mm`` for the experts; ``tt_turbo_ref_moe``: turbo on but TorchTitan's own router and
  token gather / combine (``kernels.moe_router=torch``, ``kernels.moe_permute=torch``; ``tt_turbo`` runs
  primus-turbo's Triton router and permute / unpermute);
- ``mg_turbo_fp8`` / ``tt_turbo_fp8``: turbo with ``kernels.fp8=rowwise`` (FP8 linears, the routed experts on
  primus-turbo's FP8 grouped GEMM, ``torch._scaled_grouped_mm``); MFU still against the bf16 peak.

Reported per case: tokens/s per device (median of the steps after ``--warmup``), MFU as Primus reports it (active
parameters, primus.core.planner.modelmath.flops_per_token, against the H200's dense bf16 peak), peak memory (memory_gib) and
the last loss; ratios against ``mg_core``. A failed case records its error and the others run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import breakdown, run_overrides, versions  # noqa: E402
from megatron_vs_primus import CORE_KERNELS  # noqa: E402

CASES = {
    "mg_core": ("megatron", CORE_KERNELS),
    "mg_grouped": ("megatron", [*CORE_KERNELS, "kernels.grouped_gemm=grouped_mm"]),
    "mg_turbo": ("megatron", []),
    "tt_core": ("torchtitan", CORE_KERNELS),
    "tt_grouped": ("torchtitan", [*CORE_KERNELS, "kernels.grouped_gemm=grouped_mm"]),
    "tt_turbo": ("torchtitan", []),
    "tt_turbo_ref_moe": ("torchtitan", ["kernels.moe_permute=torch", "kernels.moe_router=torch"]),
    # FP8 rowwise (a bf16 run, --smoke's fp32 too): attention and shared-expert linears FP8 linears, routed experts
    # the FP8 grouped GEMM
    "mg_turbo_fp8": ("megatron", ["kernels.fp8=rowwise", "train.precision=bf16"]),
    "tt_turbo_fp8": ("torchtitan", ["kernels.fp8=rowwise", "train.precision=bf16"]),
    # the experts forced onto the FP8 grouped GEMM (kernels.fp8_recipe.experts: auto keeps them bf16 where the GEMM
    # was not measured faster than bf16's)
    "mg_turbo_fp8_experts": (
        "megatron",
        ["kernels.fp8=rowwise", "kernels.fp8_recipe.experts=fp8", "train.precision=bf16"],
    ),
    "tt_turbo_fp8_experts": (
        "torchtitan",
        ["kernels.fp8=rowwise", "kernels.fp8_recipe.experts=fp8", "train.precision=bf16"],
    ),
}


def run_case(case: str, args: argparse.Namespace, work: Path) -> dict:
    backend, kernels = CASES[case]
    out = work / case
    model = ["tiny-qwen3-moe"] if args.smoke else [args.preset, f"model.num_layers={args.layers}"]
    cmd = [sys.executable, "-m", "primus.core.cli.app", "train", *model, f"backend.name={backend}"]
    # megatron's / torchtitan's own init: canonical init draws every expert on the CPU, minutes at this size
    cmd += ["model.moe.balancing=none", "train.init=engine", f"train.precision={args.precision}", *kernels]
    cmd += [*run_overrides(out, args.seq, args.micro_batch, args.steps), *args.extra]
    if args.profile:  # the last steps but one: two of profiler warmup, two traced (analysed as `primus analyze` does)
        cmd += [
            "profile.enabled=true",
            f"profile.wait={max(0, args.steps - 5)}",
            "profile.warmup=2",
            "profile.active=2",
        ]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout)
    row: dict = {"case": case, "backend": backend, "command": " ".join(cmd[2:]), "wall_s": time.monotonic() - start}
    if proc.returncode != 0:
        return {**row, "error": (proc.stdout + proc.stderr)[-3000:]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if r["step"] > args.warmup]
    summary = json.loads((out / "summary.json").read_text())
    return {
        **row,
        "tokens_per_s_per_device": statistics.median(r["tokens_per_s_per_device"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady) if "mfu" in steady[0] else None,
        "peak_memory_gib": max(r["memory_gib"] for r in rows),
        "loss_first_last": [rows[0]["loss"], rows[-1]["loss"]],
        "losses": [r["loss"] for r in rows],
        "kernels_applied": summary.get("kernels_applied"),
        "kernels": summary.get("kernels"),
        **({"profile": breakdown(out / "traces" / "rank0.json")} if args.profile else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="an MoE preset (mixtral-8x7b: megatron cases only)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--case-timeout", type=int, default=180)
    ap.add_argument("--extra", nargs="*", default=[], help="config overrides added to every case")
    ap.add_argument("--smoke", action="store_true", help="tiny-qwen3-moe, 4 steps, seq 64, fp32")
    ap.add_argument("--profile", action="store_true", help="trace two steps; kernel categories and top kernels")
    args = ap.parse_args()
    if args.smoke:
        args.seq, args.steps, args.warmup, args.precision = 64, 4, 1, "fp32"
    out = Path(args.out)
    result = {"argv": sys.argv, "versions": versions(), "preset": args.preset, "layers": args.layers, "seq": args.seq}
    result["cases"] = []
    work = out.parent / (out.stem + "_runs")
    for i, case in enumerate(args.cases.split(",")):
        print(f"--- {case}", flush=True)
        try:
            row = run_case(case, args, work / f"{i:02d}")  # a case may repeat (alternated runs): its own folder
        except subprocess.TimeoutExpired as exc:
            row = {"case": case, "error": f"timed out after {exc.timeout} s"}
        result["cases"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("command",)})[:2000], flush=True)
        base = next((r for r in result["cases"] if r["case"] == "mg_core" and "error" not in r), None)
        for r in result["cases"]:
            if base and "error" not in r:
                r["vs_mg_core"] = r["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
