"""GEMM tuning end to end: `primus train` on the torchtitan backend with ``kernels.gemm_tuning`` off / online /
offline, interleaved in one process on one GPU (issue #11).

    python benchmarks/gemm_tuning_e2e.py --out benchmarks/results/gemm_tuning_e2e.json

Model: the Llama 3.2 1B preset, seq 4096, micro-batch 2, bf16, eager (tuned dispatch is eager-only: nvmath calls
would break a compiled graph at every linear), random tokens. Each run is a full ``primus train`` (the backend's
own training loop, primus-tune wired in through the plugin hooks):

- off: cuBLAS's default algorithm for every GEMM.
- offline: ``--offline-file`` (made by ``primus tune gemm record`` + ``run`` on this GPU type, committed under
  results/) is loaded; linears dispatch to the tuned cuBLASLt algorithm where it won.
- online: the shapes seen in the first ``--online-steps`` steps are searched (cuBLASLt through nvmath) after those
  steps, then the winners dispatch; its results file is written at the end of the run.

Each run's tokens/s is the median over its steps after ``--warmup`` (online: warmup must exceed the online steps,
so the search itself is not in the median; its cost is reported as ``search_s``). Modes rotate order every round
(the GPU drifts a few % over minutes); the result per mode is the median over rounds, and the gains vs off.
``--smoke`` runs the tiny preset for 6 steps (a check of this script on a GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import run_overrides, run_shape_args  # noqa: E402

MODES = ("off", "offline", "online")


def run_mode(mode: str, args: argparse.Namespace, out: Path, online_file: Path) -> dict:
    from primus.core.launch.rank import run_rank
    from primus.core.launch.resolve import resolve

    overrides = [
        *run_overrides(out, args.seq, args.micro_batch, args.steps),
        "train.schedule.warmup_steps=2",
        "train.precision=bf16",
        "train.compile=false",
        "backend.name=torchtitan",
        f"kernels.gemm_tuning={mode}",
        f"kernels.gemm_tuning_online_steps={args.online_steps}",
    ]
    if mode == "offline":
        overrides.append(f"kernels.gemm_tuning_file={args.offline_file}")
    if mode == "online":
        overrides.append(f"kernels.gemm_tuning_file={online_file}")
    t0 = time.perf_counter()
    summary = run_rank(resolve(args.preset, overrides, world_size=1))
    wall = time.perf_counter() - t0
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
    torch.cuda.empty_cache()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s_per_device"] for r in rows]
    step_s = [args.seq * args.micro_batch / t for t in tps]
    return {
        "tokens_per_s": statistics.median(tps[args.warmup :]),
        "mfu": statistics.median([r.get("mfu") or 0.0 for r in rows[args.warmup :]]),
        "loss_last": rows[-1]["loss"],
        # online: the steps that searched took longer than a steady step by the search time
        "search_s": sum(step_s[: args.online_steps + 1]) - (args.online_steps + 1) * statistics.median(step_s),
        "wall_s": wall,
        "gemm_tuning": summary.get("gemm_tuning"),
        "command": f"primus train {args.preset} " + shlex.join(overrides),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gemm_tuning_e2e.json")
    ap.add_argument("--preset", default="llama3.2-1b")
    ap.add_argument("--offline-file", default="benchmarks/results/llama3.2-1b-gemm-h200.json")
    run_shape_args(ap, steps=30, warmup=8)
    ap.add_argument("--online-steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny preset, 6 steps, 1 round: checks the script")
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.seq, args.steps, args.warmup, args.rounds, args.online_steps = "tiny-llama", 128, 6, 3, 1, 1
    result: dict = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "preset": args.preset,
        "seq_len": args.seq,
        "micro_batch_size": args.micro_batch,
        "steps": args.steps,
        "warmup_steps_excluded": args.warmup,
        "offline_file": args.offline_file,
        "rounds": [],
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = MODES[r % 3 :] + MODES[: r % 3]
            row: dict = {}
            for mode in order:
                try:
                    row[mode] = run_mode(mode, args, Path(tmp) / f"{mode}{r}", Path(tmp) / f"online{r}.json")
                except Exception:
                    row[mode] = {"error": traceback.format_exc()}
                print(
                    json.dumps({"round": r, "mode": mode, **{k: v for k, v in row[mode].items() if k != "command"}}),
                    flush=True,
                )
            result["rounds"].append(row)
            save()
    ok = {m: [row[m]["tokens_per_s"] for row in result["rounds"] if "tokens_per_s" in row[m]] for m in MODES}
    result["tokens_per_s"] = {m: statistics.median(v) for m, v in ok.items() if v}
    base = result["tokens_per_s"].get("off")
    if base:
        result["gain_vs_off"] = {m: v / base - 1 for m, v in result["tokens_per_s"].items() if m != "off"}
    result["goal"] = "end-to-end gain from tuning >= +2% on the 1B preset"
    save()
    print(json.dumps({k: result.get(k) for k in ("tokens_per_s", "gain_vs_off")}), flush=True)


if __name__ == "__main__":
    main()
