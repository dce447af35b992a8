"""MoE kernels, forward and backward, primus-turbo's Triton against TorchTitan's own math (core's references), bf16, one
GPU: the token permute + weighted unpermute (core's reference: ``x[order // k]``, then zeros + index_copy + an fp32
batched [1, k] x [k, d] product) and the router after its gate (fp32 softmax / sigmoid, topk, gather, renormalise),
on the shapes of Qwen3-30B-A3B (d 2048, 128 experts, top 8) and Mixtral 8x7B (d 4096, 8 experts, top 2); and the
experts' first GEMM (gate + up: w ``[E, 2·ffn, d]``) on the routed tokens, primus-turbo's FP8 grouped GEMM (rowwise;
``torch._scaled_grouped_mm`` on sm90) against the bf16 ``grouped_mm``, with its relative error against fp32.

    python3 benchmarks/moe_kernels_h200.py --out benchmarks/results/moe_kernels_h200.json
    python3 benchmarks/moe_kernels_h200.py --out /tmp/smoke.json --smoke     # CPU: Triton's interpreter, no speed

Per op, shape and implementation: milliseconds per forward + backward (median of --iters after warmup, CUDA events)
and the largest difference of the outputs and input gradients from the reference.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import versions  # noqa: E402

SHAPES = {  # name: (tokens, d, experts, top k, expert ffn)
    "qwen3-30b-a3b s4096": (4096, 2048, 128, 8, 768),
    "qwen3-30b-a3b s8192": (8192, 2048, 128, 8, 768),
    "mixtral-8x7b s4096": (4096, 4096, 8, 2, 14336),
}


def gemm_step(impl, x, w, offs, grad):
    y = impl(x, w, offs)
    y.backward(grad)
    return y


def step(impl, x, order, probs, k, grad):
    routed = impl(x, order, k)
    out = impl.unpermute(routed * 1.5, order, probs)  # a stand-in for the experts between the two
    out.backward(grad)
    return out


def router_step(impl, logits, k, grad):
    probs, _ = impl(logits, k, score="softmax", normalize=True)
    probs.backward(grad)
    return probs


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Milliseconds per call after ``warmup`` calls: CUDA events on a GPU; wall time on the CPU (--smoke: Triton's
    interpreter, no speed)."""
    times = []
    for i in range(iters + warmup):
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
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from primus.core.kernels import reference
    from primus.core.kernels.fp8_recipe import Fp8Recipe
    from primus.turbo.fp8.grouped import grouped_gemm_for, grouped_kernel_runs
    from primus.turbo.grouped_gemm import grouped_gemm
    from primus.turbo.triton import moe_permute as turbo
    from primus.turbo.triton import moe_router as turbo_router

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 1 iteration (CPU: Triton's interpreter)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = {"smoke": (64, 128, 8, 2, 64)} if args.smoke else SHAPES
    args.iters = 1 if args.smoke else args.iters
    warmup = 0 if args.smoke else 3  # the interpreter takes seconds a call, and --smoke measures no speed
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "versions": versions(), "shapes": []}
    result["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    # the fp8 quantizers: Triton on a GPU (what "auto" picks there), and in --smoke on CPU (the interpreter)
    fp8_quantize = "triton" if dev.type == "cuda" or args.smoke else "torch"
    fp8_gemm = functools.partial(grouped_gemm_for(Fp8Recipe(mode="rowwise")), impl=fp8_quantize)
    for name, (tokens, d, experts, k, ffn) in shapes.items():
        torch.manual_seed(0)
        indices = torch.randn(tokens, experts, device=dev).topk(k, dim=1).indices
        order = torch.argsort(indices.reshape(-1), stable=True)
        base = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16)
        probs0 = torch.rand(tokens, k, device=dev)
        grad = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16)
        row = {"shape": name, "tokens": tokens, "d": d, "experts": experts, "k": k}
        outs = {}
        for label, impl in (("torch", reference.moe_permute), ("triton", turbo.moe_permute)):
            x, probs = base.clone().requires_grad_(), probs0.clone().requires_grad_()
            out = step(impl, x, order, probs, k, grad)
            outs[label] = (out.detach().float(), x.grad.float(), probs.grad.float())
            x, probs = base.clone().requires_grad_(), probs0.clone().requires_grad_()
            row[f"{label}_ms"] = round(timed(lambda: step(impl, x, order, probs, k, grad), args.iters, warmup), 4)  # noqa: B023
        row["speedup"] = round(row["torch_ms"] / row["triton_ms"], 3)
        for i, what in enumerate(("out", "dx", "dprobs")):
            row[f"max_diff_{what}"] = float((outs["torch"][i] - outs["triton"][i]).abs().max())
        print(json.dumps(row), flush=True)
        result["shapes"].append({"op": "moe_permute", **row})
        # the router on the same tokens: [T, E] gate logits in bf16
        logits0 = torch.randn(tokens, experts, device=dev, dtype=torch.bfloat16)
        rgrad = torch.randn(tokens, k, device=dev)
        row = {"op": "moe_router", "shape": name, "tokens": tokens, "experts": experts, "k": k}
        outs = {}
        for label, impl in (("torch", reference.moe_router), ("triton", turbo_router.moe_router)):
            logits = logits0.clone().requires_grad_()
            probs = router_step(impl, logits, k, rgrad)
            outs[label] = (probs.detach().sort(dim=1).values, logits.grad.float())
            logits = logits0.clone().requires_grad_()
            row[f"{label}_ms"] = round(timed(lambda: router_step(impl, logits, k, rgrad), args.iters, warmup), 4)  # noqa: B023
        row["speedup"] = round(row["torch_ms"] / row["triton_ms"], 3)
        row["max_diff_probs"] = float((outs["torch"][0] - outs["triton"][0]).abs().max())
        row["max_diff_dlogits"] = float((outs["torch"][1] - outs["triton"][1]).abs().max())
        print(json.dumps(row), flush=True)
        result["shapes"].append(row)
        # the experts' gate + up GEMM on the routed tokens (T·k rows sorted by expert), bf16 weights
        offs = torch.bincount(indices.reshape(-1), minlength=experts).cumsum(0).to(torch.int32)
        x0 = base[order // k]
        w0 = torch.randn(experts, 2 * ffn, d, device=dev, dtype=torch.bfloat16) / d**0.5
        ggrad = torch.randn(x0.shape[0], 2 * ffn, device=dev, dtype=torch.bfloat16)
        row = {"op": "grouped_gemm", "shape": name, "rows": x0.shape[0], "d": d, "experts": experts, "n": 2 * ffn}
        row["fp8_kernel"] = "torch._scaled_grouped_mm" if grouped_kernel_runs(dev) else "torch._scaled_mm per expert"
        row["fp8_quantize"] = fp8_quantize
        outs = {}
        for label, impl in (("bf16", grouped_gemm), ("fp8", fp8_gemm), ("fp32", reference.grouped_gemm)):
            cast = torch.float32 if label == "fp32" else torch.bfloat16
            x, w = x0.to(cast).clone().requires_grad_(), w0.to(cast).clone().requires_grad_()
            y = gemm_step(impl, x, w, offs, ggrad.to(cast))
            outs[label] = (y.detach().float(), x.grad.float(), w.grad.float())
            if label != "fp32" or args.smoke:
                x, w = x0.to(cast).clone().requires_grad_(), w0.to(cast).clone().requires_grad_()
                fn = lambda: gemm_step(impl, x, w, offs, ggrad.to(cast))  # noqa: B023, E731
                row[f"{label}_ms"] = round(timed(fn, args.iters, warmup), 4)
        row["speedup_fp8"] = round(row["bf16_ms"] / row["fp8_ms"], 3)
        for label in ("bf16", "fp8"):
            for i, what in enumerate(("y", "dx", "dw")):
                ref = outs["fp32"][i]
                row[f"rel_err_{label}_{what}"] = float((outs[label][i] - ref).norm() / ref.norm())
        print(json.dumps(row), flush=True)
        result["shapes"].append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
