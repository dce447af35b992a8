"""primus-turbo's FP8 linear against bf16's, forward + backward, on the linears of Llama 3.x 1B / 8B / 70B at 8192
tokens (seq 4096 x micro-batch 2), one GPU: eager (Triton quantizers) and under torch.compile (inductor fuses the
quantization into its neighbours), rowwise and tensorwise. What core's FP8 rule for dense linears reads: a linear
whose shape is not measured faster in FP8 stays bf16 under ``kernels.fp8_recipe.linears: auto``.

    python3 benchmarks/fp8_linear_shapes.py --out benchmarks/results/fp8_linear_shapes_h100.json
    python3 benchmarks/fp8_linear_shapes.py --out /tmp/smoke.json --smoke     # CPU: the code, no speed

Per shape (out_features N, in_features K) and variant: milliseconds per forward + backward (median of --iters,
CUDA events), and the ratio bf16 / fp8 (above 1: FP8 faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _common import versions  # noqa: E402

SHAPES = {  # name: (out_features, in_features)
    "1b q/o": (2048, 2048),
    "1b kv": (512, 2048),
    "1b w1/w3": (8192, 2048),
    "1b w2": (2048, 8192),
    "8b q/o": (4096, 4096),
    "8b kv": (1024, 4096),
    "8b w1/w3": (14336, 4096),
    "8b w2": (4096, 14336),
    "70b q/o": (8192, 8192),
    "70b kv": (1024, 8192),
    "70b w1/w3": (28672, 8192),
    "70b w2": (8192, 28672),
}


def timed(fn, iters: int) -> float:
    times = []
    for i in range(iters + 3):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 3:
            times.append(ms)
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from primus.core.kernels.fp8_recipe import Fp8Recipe
    from primus.turbo.fp8.linear import fp8_linear

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="two tiny shapes, eager only, 1 iteration")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    shapes = {"smoke a": (64, 64), "smoke b": (128, 64)} if args.smoke else SHAPES
    tokens, iters = (32, 1) if args.smoke else (args.tokens, args.iters)
    recipes = {m: Fp8Recipe(mode=m) for m in ("rowwise", "tensorwise")}

    def bf16(x, w):
        return F.linear(x, w)

    def fp8(mode):
        return lambda x, w: fp8_linear(x, w, recipe=recipes[mode])

    variants = {"bf16": bf16, "fp8_rowwise": fp8("rowwise"), "fp8_tensorwise": fp8("tensorwise")}
    compiled = {} if args.smoke else {k: torch.compile(v, dynamic=False) for k, v in variants.items()}
    torch._dynamo.config.cache_size_limit = 64
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "versions": versions(), "rows": []}
    result["device"] = torch.cuda.get_device_name() if gpu else "cpu"
    result["tokens"] = tokens
    for name, (n, k) in shapes.items():
        torch.manual_seed(0)
        x0 = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
        w0 = (torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16)
        g = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
        row = {"shape": name, "out_features": n, "in_features": k}
        for tag, table in (("eager", variants), ("compiled", compiled)):
            for label, fn in table.items():
                x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()

                def step(fn=fn, x=x, w=w, g=g):
                    y = fn(x, w)
                    return torch.autograd.grad(y, (x, w), g)

                try:
                    row[f"{tag}_{label}_ms"] = round(timed(step, iters), 4)
                except Exception as e:  # noqa: BLE001 - a failing variant is a row's note, not the run's end
                    row[f"{tag}_{label}_error"] = f"{type(e).__name__}: {e}"[:300]
            for mode in ("rowwise", "tensorwise"):
                base, f8 = row.get(f"{tag}_bf16_ms"), row.get(f"{tag}_fp8_{mode}_ms")
                if base and f8:
                    row[f"{tag}_{mode}_speedup"] = round(base / f8, 3)
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
