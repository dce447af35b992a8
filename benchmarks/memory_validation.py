"""The planner's per-GPU memory prediction against the peak a real run measures, on one GPU, both engines.

    python3 benchmarks/memory_validation.py --out benchmarks/results/memory_validation.json \\
        --trace-out packages/primus-core/tests/data/h200_llama3.2-1b_torchtitan.trace.json.gz
    python3 benchmarks/memory_validation.py --smoke --out /tmp/mv.json --trace-out /tmp/trace.json.gz
    python3 benchmarks/memory_validation.py --fp8 --out benchmarks/results/memory_validation_fp8.json

Each case (engine × preset × seq × micro-batch × recompute) is ``primus train`` resolved and run for a few
steps in a fresh process (a clean allocator and clean engine globals), through the backends' own code
(``primus.core.launch.rank.run_rank``). Recorded per case: the planner's prediction for that exact config
(``primus.core.planner.strategies.estimate_memory``, the estimate ``primus train`` checks before it starts) by
category; ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``; the memory outside the allocator
(device used per ``torch.cuda.mem_get_info`` minus reserved, at the end of the run: CUDA context, NCCL);
and the errors: total predicted vs measured device peak (reserved + outside), allocator share predicted vs
reserved, allocated predicted vs max allocated. Target: within ±10%. Constants to recalibrate live in
``primus.core.planner.calibration``.

``--trace-out`` also runs one profiled TorchTitan step of the Llama 3.2 1B preset (wait 1, warmup 1, active
1) and stores its Chrome trace trimmed to the device timeline (kernels, copies, step annotations and the
trace's ``primus`` block with the step's model FLOPs), gzipped: the stored H200 trace that
``packages/primus-core/tests/test_profile_h200_trace.py`` analyzes.

On a machine without a GPU, ``--smoke`` runs tiny presets on the CPU (a check of this script; no memory
numbers). The JSON is rewritten after every case; a failed case records its error and the run goes on.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import run_overrides  # noqa: E402

GIB = 2**30

# (engine, preset, seq, micro-batch, recompute): ~10-20 s each on an H200, startup included
FULL_CASES = [
    ("torchtitan", "llama3.2-1b", 4096, 2, "none"),
    ("torchtitan", "llama3.2-1b", 4096, 2, "selective"),
    ("torchtitan", "llama3.2-1b", 4096, 2, "full"),
    ("torchtitan", "llama3.2-3b", 4096, 1, "none"),
    ("torchtitan", "qwen2.5-0.5b", 2048, 4, "none"),
    ("megatron", "llama3.2-1b", 4096, 2, "none"),
    ("megatron", "llama3.2-1b", 4096, 2, "full"),
    ("megatron", "qwen2.5-1.5b", 4096, 2, "full"),
    ("megatron", "qwen2.5-0.5b", 2048, 4, "none"),
]
# --fp8: compiled TorchTitan runs in bf16 and with FP8 linears, each pair from the same config (a sixth element:
# more overrides). Measured throughput runs put FP8 15-16 GiB below bf16 on 3B where the planner puts it 2.6 above
# (benchmarks/README.md, session 5); these are the cases to recalibrate the FP8 and compiled terms on.
COMPILED = ("train.compile=true", "kernels.rms_norm=torch", "kernels.swiglu=torch")
FP8_CASES = [
    (*case, [*COMPILED, *fp8])
    for case in (
        ("torchtitan", "llama3.2-1b", 4096, 2, "none"),
        *(("torchtitan", "llama3.2-3b", 4096, m, "none") for m in (2, 4)),
    )
    for fp8 in ((), ("kernels.fp8=tensorwise",))
]
SMOKE_CASES = [("torchtitan", "qwen2.5-0.5b", 1024, 1, "none"), ("megatron", "qwen2.5-0.5b", 1024, 1, "none")]
CPU_SMOKE_CASES = [("torchtitan", "tiny-llama", 64, 2, "none"), ("megatron", "tiny-llama", 64, 2, "none")]
TRACE_CASE = ("torchtitan", "llama3.2-1b", 4096, 2, "none")
SMOKE_TRACE_CASE = ("torchtitan", "qwen2.5-0.5b", 1024, 1, "none")
CPU_TRACE_CASE = ("torchtitan", "tiny-llama", 64, 2, "none")
# what the stored trace keeps: the device timeline and the step marks (CPU operators are most of the bytes)
KEPT_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "user_annotation"}


def overrides(engine: str, seq: int, micro: int, recompute: str, steps: int, out: Path, gpu: bool) -> list[str]:
    return [
        f"backend.name={engine}",
        *run_overrides(out, seq, micro, steps),
        f"train.global_batch_size={micro}",
        f"train.precision={'bf16' if gpu else 'fp32'}",
        "train.schedule.warmup_steps=1",
        f"parallel.recompute={recompute}",
    ]


# ------------------------------------------------------------------------------------------------ workers


def run_case(case: list, steps: int, workdir: Path, profile: bool) -> dict:
    """One ``primus train`` in this process; returns predicted and measured memory."""
    import torch

    from primus.core.launch.rank import run_rank
    from primus.core.launch.resolve import resolve
    from primus.core.planner.memory import MemoryBreakdown
    from primus.core.planner.strategies import estimate_memory

    engine, preset, seq, micro, recompute, *extra = case
    gpu = torch.cuda.is_available()
    ov = overrides(engine, seq, micro, recompute, steps, workdir, gpu) + [o for more in extra for o in more]
    if profile:
        ov += ["profile.enabled=true", "profile.wait=1", "profile.warmup=1", "profile.active=1"]
    res = resolve(preset, ov, world_size=1)
    pred = MemoryBreakdown(dict(estimate_memory(res.config, 1).parts))
    if gpu:
        torch.cuda.reset_peak_memory_stats()
        # torchtitan's metrics processor resets the peak at every logged step: keep the run's peak instead
        torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    t0 = time.perf_counter()
    summary = run_rank(res)
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    out = {
        "case": dict(
            engine=engine, preset=preset, seq_len=seq, micro_batch=micro, recompute=recompute, steps=steps, extra=extra
        ),
        "command": f"primus train {preset} " + shlex.join(ov),
        "status": summary.get("status"),
        "seconds": seconds,
        "predicted_gib": {k: v / GIB for k, v in pred.parts.items()},
        "predicted_total_gib": pred.total / GIB,
        "predicted_allocator_gib": pred.allocator / GIB,
        "predicted_allocated_gib": pred.allocated / GIB,
        "backend_memory_gib": [r.get("memory_gib") for r in rows],
        "loss": [r.get("loss") for r in rows],
        "tokens_per_s": [r.get("tokens_per_s_per_device") for r in rows],
        "mfu": [r.get("mfu") for r in rows],
    }
    if gpu:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        outside = (total - free) - torch.cuda.memory_reserved()
        peak_alloc, peak_res = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        out.update(
            max_allocated_gib=peak_alloc / GIB,
            max_reserved_gib=peak_res / GIB,
            outside_allocator_gib=outside / GIB,
            measured_peak_gib=(peak_res + outside) / GIB,
            error_total=pred.total / (peak_res + outside) - 1,
            error_allocator=pred.allocator / peak_res - 1,
            error_allocated=pred.allocated / peak_alloc - 1,
        )
    return out


def trim_trace(src: Path, dst: Path) -> dict:
    """Keep the device timeline, step marks and metadata of a Chrome trace; gzip it to ``dst``."""
    data = json.loads(src.read_text())
    kept = [e for e in data["traceEvents"] if e.get("cat") in KEPT_CATEGORIES or e.get("ph") == "M"]
    data["traceEvents"] = kept
    dst.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(dst, "wt") as fh:
        json.dump(data, fh, separators=(",", ":"))
    return {"trace": str(dst), "events": len(kept), "bytes": dst.stat().st_size, "source_bytes": src.stat().st_size}


def worker(args: argparse.Namespace) -> None:
    case = json.loads(args.worker)
    workdir = Path(args.workdir)
    result = run_case(case, args.steps, workdir, profile=bool(args.trace_out))
    if args.trace_out:
        result["trace"] = trim_trace(workdir / "traces" / "rank0.json", Path(args.trace_out))
        from primus.core.profile.analyze import analyze_files

        (rep,) = analyze_files([Path(args.trace_out)])
        result["trace"].update(step_ms=rep.step_us / 1e3, mfu=rep.mfu, shares=rep.shares(), categories=rep.categories)
    Path(args.result).write_text(json.dumps(result))
    os._exit(0)  # megatron's and NCCL's teardown: nothing left to flush


# ------------------------------------------------------------------------------------------------ driver


def spawn(case: tuple, args: argparse.Namespace, tmp: Path, trace_out: str | None) -> dict:
    name = "_".join(str(x) for x in case)
    workdir, result = tmp / name, tmp / f"{name}.json"
    cmd = [sys.executable, __file__, "--worker", json.dumps(list(case)), "--steps", str(args.steps)]
    cmd += ["--workdir", str(workdir), "--result", str(result)] + (["--trace-out", trace_out] if trace_out else [])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=args.case_timeout)
    except subprocess.TimeoutExpired:
        return {"case": list(case), "error": f"timed out after {args.case_timeout} s"}
    if proc.returncode != 0 or not result.is_file():
        tail = (proc.stdout[-2000:] + proc.stderr[-4000:]).strip()
        return {"case": list(case), "error": f"exit {proc.returncode}", "log_tail": tail}
    out = json.loads(result.read_text())
    out["wall_s"] = time.perf_counter() - t0
    return out


def versions() -> dict:
    import torch

    out = {"torch": torch.__version__}
    for dist in ("triton", "megatron-core", "torchtitan", "primus-core", "primus-megatron", "primus-torchtitan"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def table(cases: list[dict]) -> str:
    lines = [
        "| engine | preset | seq | mbs | recompute | predicted GiB | measured peak GiB (reserved + outside) | error "
        "| predicted allocated | max allocated | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        k = c["case"]
        if not isinstance(k, dict):  # a failed case keeps the tuple it was given
            k = dict(zip(("engine", "preset", "seq_len", "micro_batch", "recompute"), k[:5], strict=True), extra=k[5:])
        k = {**k, "recompute": " ".join([k["recompute"], *(o for more in k.get("extra", []) for o in more)])}
        if "error" in c or "measured_peak_gib" not in c:
            lines.append(
                f"| {k['engine']} | {k['preset']} | {k['seq_len']} | {k['micro_batch']} | {k['recompute']} | "
                f"{c.get('predicted_total_gib', float('nan')):.1f} | {c.get('error', 'no GPU')} | | | | |"
            )
            continue
        lines.append(
            f"| {k['engine']} | {k['preset']} | {k['seq_len']} | {k['micro_batch']} | {k['recompute']} "
            f"| {c['predicted_total_gib']:.1f} | {c['measured_peak_gib']:.1f} | {c['error_total']:+.1%} "
            f"| {c['predicted_allocated_gib']:.1f} | {c['max_allocated_gib']:.1f} | {c['error_allocated']:+.1%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/memory_validation.json")
    ap.add_argument("--trace-out", help="also store a trimmed, gzipped Chrome trace of one real step here")
    ap.add_argument("--smoke", action="store_true", help="two small cases, 2 steps (< 60 s)")
    ap.add_argument("--fp8", action="store_true", help="the compiled bf16 / FP8 pairs (FP8_CASES) instead")
    ap.add_argument("--steps", type=int, default=None, help="steps per case (default 3; smoke 2)")
    ap.add_argument("--case-timeout", type=int, default=120)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.steps = args.steps or (2 if args.smoke else 3)
    if args.worker:
        worker(args)
        return

    import torch

    gpu = torch.cuda.is_available()
    if args.smoke:
        cases, trace_case = (SMOKE_CASES, SMOKE_TRACE_CASE) if gpu else (CPU_SMOKE_CASES, CPU_TRACE_CASE)
    elif args.fp8:
        cases, trace_case = FP8_CASES, TRACE_CASE
    else:
        cases, trace_case = FULL_CASES, TRACE_CASE
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(0) if gpu else "cpu",
        "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / GIB if gpu else None,
        "versions": versions(),
        "target": "predicted within ±10% of measured (error_total: planner total vs reserved + outside allocator)",
        "cases": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        ok = [c for c in result["cases"] if "error_total" in c]
        result["within_10pct"] = sum(abs(c["error_total"]) <= 0.10 for c in ok)
        result["measured_cases"] = len(ok)
        out.write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(
            f"# Planner memory vs measured ({result['gpu']})\n\n" + table(result["cases"])
        )

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.trace_out:
            print(f"[trace] {trace_case} -> {args.trace_out}", flush=True)
            r = spawn(trace_case, args, Path(tmp), str(Path(args.trace_out).resolve()))
            result["trace_case"] = r
            print("   ", json.dumps(r.get("trace") or r.get("error")), flush=True)
            save()
        for case in cases:
            print(f"[memory] {case} ...", flush=True)
            try:
                r = spawn(case, args, Path(tmp), None)
            except Exception:  # keep the partial results of a run that cannot be repeated
                r = {"case": list(case), "error": traceback.format_exc()}
            result["cases"].append(r)
            print(
                "   ",
                json.dumps(
                    {
                        k: r.get(k)
                        for k in ("error", "predicted_total_gib", "measured_peak_gib", "error_total", "error_allocated")
                    }
                ),
                flush=True,
            )
            save()
    result["total_s"] = time.perf_counter() - t_start
    save()
    print(table(result["cases"]))
    print(f"wrote {out} and {out.with_suffix('.md')} in {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()
