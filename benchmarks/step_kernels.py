"""Where a training step's kernel time goes, per category and kernel, per step and per parameter: the numbers the
planner's per-parameter terms (optimizer traffic, gradient accumulation, weight copies) are calibrated from.

    python3 benchmarks/step_kernels.py --out benchmarks/results/step_kernels_h200.json \\
        --case megatron:llama3.2-3b:seq=4096,mbs=2 --case megatron:qwen3-30b-a3b:layers=6,seq=4096,mbs=1

Each case is one ``primus train`` process (``BACKEND:PRESET[:layers=N,seq=S,mbs=B]``, core's kernel providers for a
dense model, ``kernels: auto`` for an MoE model, bf16, random tokens) tracing two steps after six; reported per case:
the parameter count, each category's ms per step and, for every kernel of the optimizer / elementwise / memory
categories among the top 60, its ms and calls per step and the bytes per parameter it would move at the device's HBM
bandwidth (``--hbm-gbps``, the H200's 4,800 by default): a kernel whose time grows with the parameters, not the
tokens, shows the same bytes per parameter on every model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import run_overrides, versions  # noqa: E402
from megatron_vs_primus import CORE_KERNELS  # noqa: E402

STEPS, TRACED = 10, 2
PER_PARAM = ("optimizer", "elementwise", "memory")


def parse_case(spec: str) -> tuple[str, str, dict[str, int]]:
    backend, preset, *rest = spec.split(":")
    opts = dict(kv.split("=") for kv in rest[0].split(",")) if rest else {}
    return backend, preset, {k: int(v) for k, v in opts.items()}


def run_case(spec: str, work: Path, hbm: float, timeout: int) -> dict:
    from primus.core.contracts.plugins import get_registry
    from primus.core.launch.cluster_plan import resolve_on
    from primus.core.planner.modelmath import count_params
    from primus.core.profile.analyze import analyze_files, categorize

    backend, preset, opts = parse_case(spec)
    out = work / spec.replace(":", "_").replace(",", "_").replace("=", "")
    model = [f"model.num_layers={opts['layers']}"] if "layers" in opts else []
    config = resolve_on(preset, model, 1, get_registry())[0].config.model
    moe = config.moe is not None
    kernels = ["model.moe.balancing=none"] if moe else CORE_KERNELS
    cmd = [sys.executable, "-m", "primus.core.cli.app", "train", preset, f"backend.name={backend}", *model, *kernels]
    cmd += [
        "train.precision=bf16",
        "train.init=engine",
        *run_overrides(out, opts.get("seq", 4096), opts.get("mbs", 1), STEPS),
    ]
    cmd += [
        "profile.enabled=true",
        f"profile.wait={STEPS - TRACED - 2}",
        "profile.warmup=2",
        f"profile.active={TRACED}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    row: dict = {"case": spec, "command": " ".join(cmd[2:])}
    if proc.returncode != 0:
        return {**row, "error": (proc.stdout + proc.stderr)[-3000:]}
    params = count_params(config).total
    report = analyze_files([out / "traces" / "rank0.json"], top_n=60)[0]
    steps = report.steps
    per_step = {k: v / 1e3 / steps for k, v in sorted(report.categories.items(), key=lambda kv: -kv[1])}
    kernels = []
    for name, us, calls in report.top:
        cat = categorize(name)
        if cat in PER_PARAM:
            ms = us / 1e3 / steps
            kernels.append({"category": cat, "ms": round(ms, 3), "calls": calls / steps, "name": name[:160],
                            "bytes_per_param": round(ms * 1e-3 * hbm * 1e9 / params, 1)})  # fmt: skip
    return {
        **row,
        "params": params,
        "step_ms": report.step_us / 1e3,
        "idle_share": report.shares()["idle"],
        "category_ms_per_step": {k: round(v, 3) for k, v in per_step.items()},
        "category_bytes_per_param": {k: round(per_step[k] * 1e-3 * hbm * 1e9 / params, 1) for k in PER_PARAM if k in per_step},
        "kernels": kernels,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--hbm-gbps", type=float, default=4800.0)
    ap.add_argument("--case-timeout", type=int, default=200)
    args = ap.parse_args()
    out = Path(args.out)
    result = {"argv": sys.argv, "versions": versions(), "cases": []}
    for spec in args.case:
        print(f"--- {spec}", flush=True)
        try:
            row = run_case(spec, out.parent / (out.stem + "_runs"), args.hbm_gbps, args.case_timeout)
        except subprocess.TimeoutExpired as exc:
            row = {"case": spec, "error": f"timed out after {exc.timeout} s"}
        result["cases"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("command", "kernels")}), flush=True)
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
