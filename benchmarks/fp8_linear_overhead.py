"""Where an eager FP8 linear's time goes: GPU kernel time against the host's launch time, per forward + backward.

``fp8_linear_shapes.py`` times one synchronised call, which is the larger of the two; in a training step the host
runs ahead of the GPU and only the GPU's kernels count, until the host falls behind. This script separates them,
with torch.profiler, at the shapes of that script:

    python3 benchmarks/fp8_linear_overhead.py --out benchmarks/results/fp8_linear_overhead_h100.json
    python3 benchmarks/fp8_linear_overhead.py --out /tmp/smoke.json --smoke     # CPU: the code, no speed

Per shape and variant (bf16, FP8 rowwise, FP8 tensorwise): ``gpu_ms`` (the sum of the kernels of one forward +
backward), ``host_ms`` (the host's wall time to issue one, the GPU kept busy so it never waits), ``kernels`` (the
kernels of one call, name and microseconds) and the host's top operators by self time.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _common import kernel_args, versions  # noqa: E402

SHAPES = {  # name: (out_features, in_features); megatron fuses q/k/v and w1/w3 into one linear each
    "1b q/o": (2048, 2048),
    "1b qkv": (3072, 2048),
    "1b fc1": (16384, 2048),
    "1b w2": (2048, 8192),
    "3b q/o": (3072, 3072),
    "3b fc1": (16384, 3072),
    "3b w2": (3072, 8192),
    "8b q/o": (4096, 4096),
    "8b qkv": (6144, 4096),
    "8b fc1": (28672, 4096),
    "8b w2": (4096, 14336),
}


def profile_calls(step, calls: int) -> tuple[float, float, list[tuple[str, float]], list[tuple[str, float]]]:
    """(GPU kernel ms per call, host ms per call, kernels of one call, host ops by self time per call)."""
    gpu = torch.cuda.is_available()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    for _ in range(3):
        step()
    if gpu:
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            step()
        if gpu:
            torch.cuda.synchronize()
    events = prof.events()
    kernels = [(e.name, e.device_time) for e in events if gpu and e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(t for _, t in kernels) / 1e3 / calls
    per_call = kernels[: len(kernels) // calls] if calls else kernels
    host = defaultdict(float)
    for e in prof.key_averages():
        host[e.key] += e.self_cpu_time_total / calls
    top = sorted(host.items(), key=lambda kv: -kv[1])[:12]
    # the host's rate, the GPU kept busy ahead of it (a large matmul queued first) so no call waits on the GPU
    if gpu:
        big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(20):
            big @ big
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    host_ms = (time.perf_counter() - t0) * 1e3 / calls
    if gpu:
        torch.cuda.synchronize()
    return gpu_ms, host_ms, [(n, round(t, 1)) for n, t in per_call], [(k, round(v, 1)) for k, v in top]


def main() -> None:
    args = kernel_args(__doc__, "one tiny shape, 1 call", tokens=8192, calls=10)
    from primus.core.kernels.fp8_recipe import Fp8Recipe
    from primus.turbo.fp8.linear import fp8_linear

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = {"smoke": (64, 64)} if args.smoke else SHAPES
    tokens, calls = (32, 1) if args.smoke else (args.tokens, args.calls)
    recipes = {m: Fp8Recipe(mode=m) for m in ("rowwise", "tensorwise")}
    variants = {
        "bf16": lambda x, w: F.linear(x, w),
        "fp8_rowwise": lambda x, w: fp8_linear(x, w, recipe=recipes["rowwise"]),
        "fp8_tensorwise": lambda x, w: fp8_linear(x, w, recipe=recipes["tensorwise"]),
    }
    result = {"command": " ".join(["python3", *sys.argv]), "versions": versions(), "tokens": tokens, "rows": []}
    for name, (n, k) in shapes.items():
        torch.manual_seed(0)
        x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16).requires_grad_()
        w = (torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16).requires_grad_()
        g = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
        for label, fn in variants.items():

            def step(fn=fn, x=x, w=w, g=g):
                return torch.autograd.grad(fn(x, w), (x, w), g)

            gpu_ms, host_ms, kernels, top = profile_calls(step, calls)
            row = {"shape": name, "out_features": n, "in_features": k, "variant": label}
            row |= {"gpu_ms": round(gpu_ms, 4), "host_ms": round(host_ms, 4), "kernels": kernels, "host_top": top}
            print(json.dumps({kk: v for kk, v in row.items() if kk not in ("kernels", "host_top")}), flush=True)
            result["rows"].append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
