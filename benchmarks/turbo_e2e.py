"""primus-turbo end to end on one GPU: plain engines vs Primus with turbo off and on, per model, in one run.

    python3 benchmarks/turbo_e2e.py --out benchmarks/results/turbo_e2e.json
    python3 benchmarks/turbo_e2e.py --out /tmp/smoke.json --smoke            # tiny model, 3 steps (CPU or GPU)
    python3 benchmarks/turbo_e2e.py --models 3b-4096 --cases mg_plain,mg_turbo --out ...

Models (``--models``): ``1b-4096``, ``3b-4096``, ``1b-8192`` (Llama 3.2 presets at that sequence length).
Cases (``--cases``), each a fresh model trained on uniform random tokens, bf16, AdamW-style optimizer:

- ``tt_plain``: plain TorchTitan 0.2.2, blocks compiled (torchtitan_vs_primus.run_plain, untied llama3);
- ``tt_core`` / ``tt_turbo``: Primus-TorchTitan, compiled, untied as plain; core's providers pinned
  (``--kernels core``: torchtitan's own modules) / kernels ``auto`` (turbo: cuDNN attention, Triton
  norm/SwiGLU, fused output projection + cross-entropy);
- ``tt_turbo_lean``: as ``tt_turbo`` with the norms and SwiGLU left to torchtitan's modules (inductor fuses
  them with their neighbours; turbo keeps attention and the fused output projection + loss);
- ``mg_plain``: plain megatron-core, local spec + SDPA core attention (megatron_vs_primus.run_plain, tied);
- ``mg_core`` / ``mg_turbo``: Primus-Megatron with core's providers pinned / turbo's (+ Triton RoPE and
  the fused output layer + loss).

Turbo cases run at the model's turbo micro-batch (``MODELS``, or ``--turbo-micro-batch``; the fused loss frees
the [tokens x vocab] logits); if that runs out of memory the case is re-run at half of it, down to the base
micro-batch. Every case records its micro-batch: compare tokens/s, which is per token whatever the batch.
A larger micro-batch also spreads the optimizer step over more tokens, so ``--same-batch`` gives the plain
and core cases the same first try (and the same fallback): where they fit, the ratio is at equal micro-batch.

Timing: ``--steps`` steps per run, the median tokens/s of steps ``--warmup``+1 .. steps-2 (the last 2 steps
are profiled by torch.profiler and excluded). The cases of one engine and model run in one worker process,
in ``--rounds`` interleaved rounds (default 2 for megatron; compiled TorchTitan cases run ``--tt-rounds``,
default 1, since a second round would recompile); the result is the median over rounds. MFU uses
6 x matmul params (output head included) + 12 x L x heads x head_dim x seq FLOPs a token against 989 TFLOP/s.
Each case also gets a kernel-time breakdown (GEMM / attention / other shares, primus.core.profile.analyze).
The JSON is rewritten after every worker; a failed case records its error.

Expected GPU time of the full run: ~9-11 minutes (6 workers); run it as two calls if one call must stay
under 10 minutes: ``--models 1b-4096,1b-8192`` and ``--models 3b-4096`` (separate ``--out`` files).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))
from _common import PEAK_BF16, breakdown, flops_per_token, release, steady, versions  # noqa: E402

# model config -> (model key in the engine benchmarks, seq, base micro-batch, turbo micro-batch)
MODELS = {
    "1b-4096": ("1b", 4096, 2, 8),  # megatron + turbo at 8: 1.48x plain (session 7; 1.41x at 4)
    "3b-4096": ("3b", 4096, 2, 8),  # turbo: the fused loss lets 3B run micro-batch 8 (135 GiB, session 6)
    "1b-8192": ("1b", 8192, 1, 4),
    "tiny-64": ("tiny", 64, 2, 4),  # --smoke
}
SHAPES = {  # for the FLOPs formula
    "1b": dict(layers=16, dim=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256),
    "3b": dict(layers=28, dim=3072, heads=24, kv_heads=8, head_dim=128, ffn=8192, vocab=128256),
    "tiny": dict(layers=2, dim=128, heads=4, kv_heads=2, head_dim=32, ffn=352, vocab=2048),
}
TT_CASES = ("tt_plain", "tt_core", "tt_turbo", "tt_turbo_lean")
LEAN = ("kernels.rms_norm=torch", "kernels.swiglu=torch")  # inductor's fusion instead of the Triton kernels
MG_CASES = ("mg_plain", "mg_core", "mg_turbo")
PROFILED = 2  # last steps of each run under the profiler, left out of the median
GOALS = {  # case -> (baseline case, least speed-up)
    "tt_turbo": ("tt_plain", 1.15),
    "tt_turbo_lean": ("tt_plain", 1.15),
    "mg_turbo": ("mg_plain", 1.45),
    "mg_core": ("mg_plain", 1.0),
}
MFU_GOAL = 0.62


# ------------------------------------------------------------------------------------------------ one case


def run_tt(case: str, key: str, seq: int, micro: int, steps: int, out: Path, global_batch: int | None) -> dict:
    import torchtitan_vs_primus as tt

    if case == "tt_plain":
        gpu = tt.torch.cuda.is_available()  # torchtitan's profiler asks for CUDA activity
        r = tt.run_plain(steps, seq, micro, out, compile_=gpu, profile=gpu, global_batch=global_batch)
        return {**r, "kernels": "torchtitan's own modules", "command": "torchtitan " + shlex.join(r.pop("argv"))}
    from megatron_vs_primus import CORE_KERNELS

    wait = max(0, steps - PROFILED - 1)
    pins = {"tt_core": CORE_KERNELS, "tt_turbo_lean": LEAN}.get(case, [])
    extra = [*pins, "profile.enabled=true", f"profile.wait={wait}", f"profile.active={PROFILED}"]
    if global_batch:
        extra.append(f"train.global_batch_size={global_batch}")
    r = tt.run_primus(tt.MODELS[key][0], steps, seq, micro, out, tt.torch.cuda.is_available(), tuple(extra))
    return {**r, "trace": str(out / "traces" / "rank0.json")}


def run_mg(case: str, key: str, seq: int, micro: int, steps: int, out: Path, global_batch: int | None) -> dict:
    import megatron_vs_primus as mg
    import torch

    if global_batch and global_batch != micro:
        raise ValueError("--global-batch: the megatron cases run one micro-batch per step (plain loop)")
    wait = max(0, steps - PROFILED - 1)
    args = SimpleNamespace(
        model=key,
        seq=seq,
        micro_batch=micro,
        steps=steps,
        log_interval=1,
        kernels="core" if case == "mg_core" else "auto",
        gpu=torch.cuda.is_available(),
        workdir=str(out),
        profile=True,
        extra=["profile.enabled=true", f"profile.wait={wait}", f"profile.active={PROFILED}"],
    )
    out.mkdir(parents=True, exist_ok=True)
    if case == "mg_plain":
        r = mg.run_plain(args)
        return {**r, "kernels": "megatron local spec + SDPA core attention", "command": "megatron-core (own loop)"}
    return {**mg.run_primus(args), "trace": str(out / "traces" / "rank0.json")}


def measure(
    case: str,
    config: str,
    steps: int,
    warmup: int,
    out: Path,
    global_batch: int | None = None,
    turbo_micro: int | None = None,
    same_batch: bool = False,
) -> dict:
    """One run of ``case``; turbo cases (every case with ``same_batch``) at the turbo micro-batch first, then
    at half of it down to the base one while they run out of memory."""
    key, seq, base, turbo = MODELS[config]
    turbo = turbo_micro or turbo
    larger = "turbo" in case or same_batch
    tries = [turbo] if larger else []
    while tries and tries[-1] // 2 > base:  # halving down to the base micro-batch
        tries.append(tries[-1] // 2)
    tries = [*dict.fromkeys([*tries, base])]
    run = run_tt if case.startswith("tt") else run_mg
    oom = []
    for micro in tries:
        release()  # the previous case's cached memory and peak counter go
        try:
            r = run(case, key, seq, micro, steps, out / f"mbs{micro}", global_batch)
        except Exception as exc:  # noqa: BLE001 - out of memory is retried at a smaller micro-batch
            if "out of memory" not in str(exc).lower() or micro == tries[-1]:
                raise
            oom.append(f"micro-batch {micro}: {str(exc).splitlines()[0][:200]}")
            continue
        last = steps - PROFILED
        tps = steady(r["tps"], warmup, r.get("steps"), last=last)
        fpt = flops_per_token(SHAPES[key], seq)
        return {
            "micro_batch": micro,
            "global_batch": global_batch or micro,
            "tokens_per_s": tps,
            "tflops_per_s": tps * fpt / 1e12,
            "mfu": tps * fpt / PEAK_BF16,
            "peak_memory_gib": r["memory_gib"],
            "loss_last": r["loss"][-1],
            "kernels": r.get("kernels"),
            "kernels_applied": r.get("kernels_applied"),
            "command": r.get("command"),
            "profile": breakdown(Path(r["trace"]) if r.get("trace") else None),
            **({"retried_after": oom} if oom else {}),
        }
    raise AssertionError("unreachable")


def worker(args: argparse.Namespace) -> None:
    """All rounds of this worker's cases of one model, in this process; results appended to ``--result``."""
    if args.worker == "tt":
        from primus.torchtitan import compat

        compat.import_torchtitan()
        import torchtitan_vs_primus as tt

        tt.register_plain(tt.MODELS[MODELS[args.config][0]][1])
    result = Path(args.result)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for case in args.cases.split(","):
                print(f"[{args.config}] round {r + 1}: {case}", flush=True)
                try:
                    row = measure(
                        case,
                        args.config,
                        args.steps,
                        args.warmup,
                        Path(tmp) / f"{case}{r}",
                        args.global_batch,
                        args.turbo_micro_batch,
                        args.same_batch,
                    )
                except Exception:  # noqa: BLE001 - record and go on with the other cases
                    row = {"error": traceback.format_exc()[-3000:]}
                    release()
                runs.append({"case": case, "round": r + 1, **row})
                print(json.dumps({k: v for k, v in runs[-1].items() if k not in ("profile", "command")}), flush=True)
                result.write_text(json.dumps(runs))
    os._exit(0)  # megatron's and NCCL's teardown: nothing left to flush


# ------------------------------------------------------------------------------------------------ driver


def summarize(runs: list[dict]) -> dict:
    """Per case: medians over its rounds, the last round's details, and errors."""
    cases: dict[str, dict] = {}
    for case in dict.fromkeys(r["case"] for r in runs):
        ok = [r for r in runs if r["case"] == case and "error" not in r]
        if not ok:
            cases[case] = {"error": next(r["error"] for r in runs if r["case"] == case)}
            continue
        med = {k: statistics.median(r[k] for r in ok) for k in ("tokens_per_s", "tflops_per_s", "mfu")}
        cases[case] = {**ok[-1], **med, "rounds": [round(r["tokens_per_s"], 1) for r in ok]}
        if failed := [r["error"][-600:] for r in runs if r["case"] == case and "error" in r]:
            cases[case]["failed_rounds"] = failed
        cases[case].pop("round", None)
        cases[case].pop("case", None)
    return cases


def goals(cases: dict) -> dict:
    out = {}
    for case, (base, want) in GOALS.items():
        if "tokens_per_s" in cases.get(case, {}) and "tokens_per_s" in cases.get(base, {}):
            ratio = cases[case]["tokens_per_s"] / cases[base]["tokens_per_s"]
            out[f"{case}_over_{base}"] = {"ratio": round(ratio, 4), "goal": want, "met": ratio >= want}
    best = max((c["mfu"] for n, c in cases.items() if "turbo" in n and "mfu" in c), default=None)
    if best is not None:
        out["best_turbo_mfu"] = {"mfu": round(best, 4), "goal": MFU_GOAL, "met": best >= MFU_GOAL}
    return out


def spawn(engine: str, config: str, cases: list[str], rounds: int, args: argparse.Namespace, tmp: Path) -> list[dict]:
    result = tmp / f"{engine}-{config}.json"
    cmd = [sys.executable, __file__, "--worker", engine, "--config", config, "--cases", ",".join(cases)]
    cmd += ["--rounds", str(rounds), "--steps", str(args.steps), "--warmup", str(args.warmup), "--result", str(result)]
    if args.global_batch:
        cmd += ["--global-batch", str(args.global_batch)]
    if args.turbo_micro_batch:
        cmd += ["--turbo-micro-batch", str(args.turbo_micro_batch)]
    if args.same_batch:
        cmd.append("--same-batch")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, text=True)
    runs = json.loads(result.read_text()) if result.is_file() else []
    if proc.returncode != 0:
        runs.append({"case": f"{engine}_worker", "round": 0, "error": f"worker exited {proc.returncode}"})
    print(f"[{config}] {engine} worker: {time.perf_counter() - t0:.0f} s", flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/turbo_e2e.json")
    ap.add_argument("--models", default="1b-4096,3b-4096,1b-8192", help=f"comma list of {list(MODELS)}")
    ap.add_argument("--cases", default=",".join(TT_CASES + MG_CASES), help="comma list of tt_*/mg_* cases")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=8, help="first steps left out of each run's median")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the megatron cases")
    ap.add_argument("--tt-rounds", type=int, default=1, help="rounds of the (compiled) TorchTitan cases")
    ap.add_argument(
        "--global-batch",
        type=int,
        help="samples per optimizer step in every case (gradient accumulation; default one micro-batch); "
        "TorchTitan cases only",
    )
    ap.add_argument("--turbo-micro-batch", type=int, help="micro-batch the turbo cases try first (default per model)")
    ap.add_argument(
        "--same-batch",
        action="store_true",
        help="the plain and core cases try the turbo micro-batch first too (a same-batch comparison where they fit)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny model, 3 steps, 1 round: checks the script")
    ap.add_argument("--worker", choices=["tt", "mg"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    if args.smoke:
        args.models, args.steps, args.warmup, args.rounds, args.tt_rounds = "tiny-64", 3 + PROFILED, 1, 1, 1
    wanted = args.cases.split(",")
    bad = [c for c in wanted if c not in TT_CASES + MG_CASES] + [m for m in args.models.split(",") if m not in MODELS]
    if bad:
        raise SystemExit(f"unknown case or model {bad}: cases {TT_CASES + MG_CASES}, models {list(MODELS)}")
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **versions(),
        "steps": args.steps,
        "warmup_steps_excluded": args.warmup,
        "profiled_last_steps_excluded": PROFILED,
        "rounds": {"megatron": args.rounds, "torchtitan_compiled": args.tt_rounds},
        "global_batch": args.global_batch or "one micro-batch",
        "precision": "bf16 (TorchTitan: autocast, fp32 params; megatron: Float16Module, fp32 main params)",
        "embeddings": "TorchTitan cases untied (torchtitan's llama3 has no tying); megatron cases tied (the presets)",
        "mfu_peak_flops": PEAK_BF16,
        "models": {},
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.models.split(","):
            runs: list[dict] = []
            for engine, names, rounds in (("tt", TT_CASES, args.tt_rounds), ("mg", MG_CASES, args.rounds)):
                cases = [c for c in names if c in wanted]
                if cases:
                    runs += spawn(engine, config, cases, rounds, args, Path(tmp))
                    cases_done = summarize(runs)
                    key, seq, base, turbo = MODELS[config]
                    result["models"][config] = {
                        "seq_len": seq,
                        "base_micro_batch": base,
                        "turbo_micro_batch_tried_first": args.turbo_micro_batch or turbo,
                        "plain_cases_tried_turbo_micro_batch": args.same_batch,
                        "cases": cases_done,
                        "goals": goals(cases_done),
                    }
                    result["gpu_seconds"] = round(time.perf_counter() - t0, 1)
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({m: v["goals"] for m, v in result["models"].items()}, indent=1))


if __name__ == "__main__":
    main()
