"""Issue #9, correctness on several GPUs: each parallel layout of each engine trains the same loss curve as one
device, from the same seed weights and data (fp32, so the curves compare tightly).

    python3 benchmarks/multi_gpu_equality.py --gpus 2 --out $OUT/multi_gpu_equality.json     # an nvidia-h200-x2
    python3 benchmarks/multi_gpu_equality.py --gpus 4 --out ...                               # adds 4-rank layouts
    python3 benchmarks/multi_gpu_equality.py --smoke --out /tmp/mge.json                      # CPU, gloo, 2 ranks

Models and data are the backends' test configs (``packages/primus-*/tests/configs/tiny.yaml``: tiny Llama, bundled
text, fp32); ``--model-overrides`` scales them up (e.g. ``model.hidden_size=1024 model.num_layers=8``). Every run
is ``primus train CONFIG ... --nproc-per-node N`` (torchrun, NCCL on GPUs with NVLink multicast off), starting
from one seed checkpoint per engine written by the one-device reference run. The JSON holds each layout's loss
curve, the largest absolute difference from the reference, and whether it is within ``--tol``.
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

from primus.core.launch.env import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    e: str(ROOT / "packages" / f"primus-{e}" / "tests" / "configs" / "tiny.yaml") for e in ("megatron", "torchtitan")
}
# engine -> layout -> (ranks, overrides); the 4-layer model lets PP 2 x VPP 2 hold a layer per chunk
LAYOUTS = {
    "megatron": {
        "dp2_distributed_optimizer": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1",
                                          "parallel.distributed_optimizer=true", "parallel.overlap_grad_reduce=true",
                                          "parallel.overlap_param_gather=true"]),
        "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
        "pp2_1f1b": (2, ["parallel.pp=2"]),
        "pp2_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b"]),
        "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    },
    "torchtitan": {
        "fsdp2": (2, ["parallel.dp_shard=2"]),
        "ddp2": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
        "tp2": (2, ["parallel.tp=2"]),
        "pp2_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b"]),
        "fsdp2_tp2": (4, ["parallel.dp_shard=2", "parallel.tp=2"]),
    },
}  # fmt: skip
MODEL = ["model.num_layers=4"]


def train(engine: str, out: Path, nproc: int, overrides: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "primus.core.cli.app",
        "train",
        CONFIGS[engine],
        f"logging.output_dir={out}",
        *overrides,
    ]
    cmd += ["--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PRIMUS_LAUNCHED")}
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    run = {"command": shlex.join(cmd[2:]), "seconds": round(time.perf_counter() - t0, 1), "rc": proc.returncode}
    if proc.returncode != 0:
        return {**run, "error": proc.stderr[-3000:]}
    if not (out / "metrics.jsonl").is_file():  # a seed-checkpoint run trains no step
        return run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        **run,
        "loss": [r["loss"] for r in rows],
        "tokens_per_s_per_device": [r["tokens_per_s_per_device"] for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/multi_gpu_equality.json")
    ap.add_argument("--gpus", type=int, default=2, help="layouts of up to this many ranks run")
    ap.add_argument("--engines", default="megatron,torchtitan")
    ap.add_argument("--tol", type=float, default=1e-3, help="largest |loss - reference| accepted (fp32)")
    ap.add_argument("--model-overrides", nargs="*", default=[])
    ap.add_argument("--work", default="/tmp/primus-multi-gpu")
    ap.add_argument("--smoke", action="store_true", help="CPU/gloo, 2 ranks, first layout per engine, 3 steps")
    args = ap.parse_args()
    import torch

    common = [*MODEL, *args.model_overrides, "checkpoint.enabled=false"] + (["train.steps=3"] if args.smoke else [])
    result: dict = {"command": shlex.join([sys.executable, *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "devices": torch.cuda.device_count() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__, "tol": args.tol, "engines": {}}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) / time.strftime("%Y%m%d-%H%M%S")
    for engine in args.engines.split(","):
        seed = work / engine / "seed"  # the reference writes the weights it starts from; every layout loads them
        load = [f"train.init_from={seed}"]
        ref = train(engine, work / engine / "ref", 1, [*common, f"train.save_initial={seed}"])
        entry: dict = {"reference": ref, "layouts": {}}
        result["engines"][engine] = entry
        layouts = list(LAYOUTS[engine].items())[: 1 if args.smoke else None]
        for name, (nproc, overrides) in layouts:
            if nproc > args.gpus or "loss" not in ref:
                continue
            run = train(engine, work / engine / name, nproc, [*common, *overrides, *load])
            if "loss" in run:
                run["max_abs_diff"] = max(abs(a - b) for a, b in zip(run["loss"], ref["loss"], strict=True))
                run["equal"] = run["max_abs_diff"] <= args.tol
            entry["layouts"][name] = run
            print(engine, name, {k: run.get(k) for k in ("max_abs_diff", "equal", "seconds", "rc")}, flush=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
