"""Issue #11: what a tuned GEMM dispatched through nvmath costs besides its kernel, next to torch.mm.

    python3 benchmarks/debug/nvmath_dispatch_cost.py --out $OUT/nvmath_dispatch_cost.json

For Llama 3.2 1B GEMM shapes (8192 tokens), each path runs the SAME cuBLASLt choice (nvmath's first heuristic vs
torch's default) three ways: host time per call (wall clock, no sync inside the loop), GPU time per call with the
host kept ahead (a sleep kernel queued first, so the calls run back to back: kernel time only), and GPU time per
call as a plain loop measures it (what primus-tune's searcher compared). The profiler lists the kernels one call
launches (an extra copy or memset would show there). ``direct`` is primus-tune's dispatch since session 4
(primus.tune.dispatch.DirectLaunch: the planned Matmul launched through nvmath's cuBLASLt binding).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "primus-tune" / "src"))

SHAPES = [  # (m, n, k, layout): forward NT, input-grad NN, weight-grad TN of the 1B MLP and a small one
    (8192, 8192, 2048, "NT"),
    (8192, 2048, 8192, "NN"),
    (2048, 8192, 8192, "TN"),
    (8192, 512, 2048, "NT"),
]


def host_us(fn, n=50) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return t * 1e6


def gpu_us(fn, n=20, ahead=True) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if ahead:
        torch.cuda._sleep(int(40e6))  # ~20 ms: the host queues all n calls before the GPU reaches them
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def kernels_of(fn) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [{"name": e.name[:90], "us": round(e.device_time, 1)} for e in prof.events() if e.device_type.name == "CUDA"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/nvmath_dispatch_cost.json")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from nvmath.linalg.advanced import Matmul

    from primus.tune.bench import operands
    from primus.tune.dispatch import DirectLaunch
    from primus.tune.searchers import lt_operands
    from primus.tune.shapes import GemmShape

    rows = []
    for m, n, k, layout in SHAPES:
        shape = GemmShape("mm", m=m, n=n, k=k, layout=layout, dtype="bfloat16", out_dtype="bfloat16")
        a, b = operands(shape, "cuda")
        x, y, flip = lt_operands(a, b)
        stream = torch.cuda.current_stream()
        mm = Matmul(x, y, stream=stream)
        first = list(mm.plan(stream=stream))[0]

        def lt(
            mm=mm, first=first, flip=flip, x=x, y=y, stream=stream
        ):  # as primus-tune's NvmathPlans dispatches a call
            mm.reset_operands(a=x, b=y, stream=stream)
            out = mm.execute(algorithm=first, stream=stream)
            return out.t() if flip else out

        direct = DirectLaunch.of(mm)  # primus-tune's dispatch: the same plan through the cuBLASLt binding

        def launch(direct=direct, x=x, y=y, flip=flip):
            out = direct(x, y)
            return out.t() if flip else out

        paths = {"torch.mm": lambda a=a, b=b: torch.mm(a, b), "nvmath": lt, "direct": launch}
        row: dict = {"shape": [m, n, k, layout], "flops": 2 * m * n * k}
        ref = torch.mm(a, b).float()
        for name, fn in paths.items():
            for _ in range(3):
                fn()
            row.setdefault("max_abs_err_vs_torch", {})[name] = (fn().float() - ref).abs().max().item()
            rec = {
                "host_us": statistics.median(host_us(fn) for _ in range(args.repeats)),
                "gpu_us_host_ahead": statistics.median(gpu_us(fn) for _ in range(args.repeats)),
                "gpu_us_plain_loop": statistics.median(gpu_us(fn, ahead=False) for _ in range(args.repeats)),
                "kernels": kernels_of(fn),
            }
            rec["tflops_host_ahead"] = row["flops"] / rec["gpu_us_host_ahead"] / 1e6
            row[name] = rec
        mm.free()
        rows.append(row)
        brief = {n: (round(row[n]["host_us"], 1), round(row[n]["gpu_us_host_ahead"], 1)) for n in paths}
        print(row["shape"], "host us, gpu us:", brief, "max err:", row["max_abs_err_vs_torch"], flush=True)
    import nvmath

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join([sys.executable, *sys.argv]), "torch": torch.__version__,
              "nvmath": nvmath.__version__, "gpu": torch.cuda.get_device_name(0), "rows": rows}  # fmt: skip
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
