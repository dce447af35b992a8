"""Issue #9, where a multi-GPU step's time goes: ``primus profile`` of a preset on N GPUs (data parallel: TorchTitan
FSDP2, Megatron DDP + distributed optimizer with overlapped reduce/gather) next to the same run on one GPU.

    python3 benchmarks/multi_gpu_profile.py --gpus 2 --out $OUT/multi_gpu_profile.json     # an nvidia-h200-x2

For each engine and device count: tokens/s per device (median of the unprofiled steps after ``--warmup``), MFU,
and from every rank's trace the step time split into compute / exposed communication / overlapped communication /
idle, and kernel time by category (primus.core.profile.analyze, the same numbers ``primus profile`` prints).
Scaling efficiency = tokens/s per device on N GPUs ÷ on one; the global batch grows with N (weak scaling).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import run_overrides, run_shape_args, steady, versions  # noqa: E402

from primus.core.launch.env import free_port  # noqa: E402

LAYOUTS = {  # engine -> overrides for N data-parallel ranks
    "torchtitan": lambda n: [f"parallel.dp_shard={n}"],
    "megatron": lambda n: [f"parallel.dp_replicate={n}", "parallel.dp_shard=1", "parallel.distributed_optimizer=true",
                           "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"],
}  # fmt: skip


def profile(engine: str, n: int, args: argparse.Namespace, out: Path) -> dict:
    overrides = [
        *run_overrides(out, args.seq, args.micro_batch, args.steps),
        f"backend.name={engine}",
        "train.precision=bf16",
        f"train.global_batch_size={args.micro_batch * n}",
        f"train.compile={'true' if engine == 'torchtitan' else 'false'}",
        f"profile.wait={args.steps - 3}",
        "profile.warmup=1",
        "profile.active=2",
        f"profile.ranks=[{','.join(map(str, range(n)))}]",
        *LAYOUTS[engine](n),
    ]
    cmd = [sys.executable, "-m", "primus.core.cli.app", "profile", args.preset, *overrides]
    cmd += ["--nproc-per-node", str(n), "--master-port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PRIMUS_LAUNCHED")}
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.case_timeout)
    run: dict = {"command": shlex.join(cmd[2:]), "seconds": round(time.perf_counter() - t0, 1), "rc": proc.returncode}
    if proc.returncode != 0:
        return {**run, "error": proc.stderr[-3000:]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = args.steps - 4  # the profiled steps (and the one before them) run slower
    run["tokens_per_s_per_device"] = steady(
        [r["tokens_per_s_per_device"] for r in rows], args.warmup, [r["step"] for r in rows], last
    )
    if all("mfu" in r for r in rows):  # only where the device's peak is known
        run["mfu"] = steady([r["mfu"] for r in rows], args.warmup, [r["step"] for r in rows], last)
    from primus.core.profile.analyze import analyze_files

    ranks = []
    for rep in analyze_files(sorted((out / "traces").glob("rank*.json"))):
        busy = sum(rep.categories.values()) or 1.0
        ranks.append(
            {
                "rank": rep.rank,
                "step_ms": round(rep.step_us / 1e3, 2),
                "shares": {k: round(v, 4) for k, v in rep.shares().items()},
                "kernel_time_shares": {k: round(v / busy, 4) for k, v in rep.categories.items()},
                "top_kernels": [{"name": k[:100], "ms": round(t / 1e3, 3), "calls": c} for k, t, c in rep.top[:6]],
            }
        )
    run["ranks"] = ranks
    report = out / "profile" / "report.md"
    run["report_md"] = report.read_text() if report.is_file() else None
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/multi_gpu_profile.json")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--engines", default="torchtitan,megatron")
    ap.add_argument("--preset", default="llama3.2-1b")
    run_shape_args(ap, steps=20, warmup=6)
    ap.add_argument("--case-timeout", type=int, default=240)
    ap.add_argument("--work", default="/tmp/primus-multi-gpu-profile")
    args = ap.parse_args()
    result: dict = {"command": shlex.join([sys.executable, *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    **versions(), "preset": args.preset, "seq_len": args.seq, "micro_batch_size": args.micro_batch,
                    "engines": {}}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) / time.strftime("%Y%m%d-%H%M%S")
    for engine in args.engines.split(","):
        entry: dict = {}
        result["engines"][engine] = entry
        for n in sorted({1, args.gpus}):
            entry[f"{n}gpu"] = run = profile(engine, n, args, work / engine / f"{n}gpu")
            print(engine, n, {k: run.get(k) for k in ("tokens_per_s_per_device", "mfu", "seconds", "rc")}, flush=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
        one, many = entry.get("1gpu", {}), entry.get(f"{args.gpus}gpu", {})
        if one.get("tokens_per_s_per_device") and many.get("tokens_per_s_per_device"):
            entry["scaling_efficiency"] = round(many["tokens_per_s_per_device"] / one["tokens_per_s_per_device"], 4)
        out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
