"""MoE token permute + weighted unpermute, forward and backward: primus-turbo's Triton row gathers against TorchTitan's
own indexing (core's reference: ``x[order // k]``, then zeros + index_copy + an fp32 batched [1, k] x [k, d] product),
on the shapes of Qwen3-30B-A3B (d 2048, top 8) and Mixtral 8x7B (d 4096, top 2), bf16, one GPU.

    python3 benchmarks/moe_permute_h200.py --out benchmarks/results/moe_permute_h200.json

Per shape and implementation: milliseconds per forward + backward (median of --iters after warmup, CUDA events) and
the largest difference of the output and the input gradients from the reference (bf16 rounding only expected).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import versions  # noqa: E402

SHAPES = {  # name: (tokens, d, experts, top k)
    "qwen3-30b-a3b s4096": (4096, 2048, 128, 8),
    "qwen3-30b-a3b s8192": (8192, 2048, 128, 8),
    "mixtral-8x7b s4096": (4096, 4096, 8, 2),
}


def step(impl, x, order, probs, k, grad):
    routed = impl(x, order, k)
    out = impl.unpermute(routed * 1.5, order, probs)  # a stand-in for the experts between the two
    out.backward(grad)
    return out


def timed(impl, x, order, probs, k, grad, iters: int) -> float:
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(impl, x, order, probs, k, grad)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    from primus.core.kernels import reference
    from primus.turbo.triton import moe_permute as turbo

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "versions": versions(), "shapes": []}
    result["device"] = torch.cuda.get_device_name()
    for name, (tokens, d, experts, k) in SHAPES.items():
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
            row[f"{label}_ms"] = round(timed(impl, x, order, probs, k, grad, args.iters), 4)
        row["speedup"] = round(row["torch_ms"] / row["triton_ms"], 3)
        for i, what in enumerate(("out", "dx", "dprobs")):
            row[f"max_diff_{what}"] = float((outs["torch"][i] - outs["triton"][i]).abs().max())
        print(json.dumps(row), flush=True)
        result["shapes"].append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
