"""Separate vs fused input projections (q/k/v, gate/up) of the Llama 3.2 presets, forward + backward, on one GPU.

    python3 benchmarks/projection_fusion.py --out benchmarks/results/projection_fusion.json

TorchTitan's Llama runs q, k and v (and the MLP's gate and up) as separate linears of one input; megatron-core
runs each group as one GEMM over the concatenated weights. This measures what the fusion is worth in eager
mode: per preset and token count, the group's forward + backward (input and weight gradients)
as separate ``F.linear`` calls (autograd sums the input's gradients) against one ``F.linear`` over a weight
concatenated in the forward (``torch.cat`` of the separate parameters, as a swap that keeps the checkpoint's
parameters must do) and over a weight stored concatenated. bf16, ``triton.testing.do_bench`` medians,
TFLOP/s of the GEMMs of the group. ``--small`` runs tiny shapes on CPU (a check of this script).

The swap it measured for (commit 8e53bf1) gained nothing under torch.compile end to end and was reverted
(benchmarks/README.md, session 7).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _common import bench_ms, versions  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
PRESETS = {  # dim, q width, kv width, ffn
    "1b": (2048, 2048, 512, 8192),
    "3b": (3072, 3072, 1024, 8192),
    "small": (64, 64, 16, 176),
}


def group(dim: int, widths: list[int], tokens: int, rep: int) -> dict:
    """fwd+bwd ms and TFLOP/s of one input projected by len(widths) weights: separate, cat per call, stored fused."""
    dt = torch.bfloat16
    x = torch.randn(tokens, dim, device=DEVICE, dtype=dt, requires_grad=True)
    ws = [(torch.randn(n, dim, device=DEVICE, dtype=dt) * dim**-0.5).requires_grad_() for n in widths]
    fused_w = torch.cat([w.detach() for w in ws]).requires_grad_()
    dys = [torch.randn(tokens, n, device=DEVICE, dtype=dt) for n in widths]
    dy = torch.cat(dys, dim=1)

    def separate() -> None:
        outs = [F.linear(x, w) for w in ws]
        torch.autograd.backward(outs, dys)

    def cat_per_call() -> None:
        F.linear(x, torch.cat(ws)).backward(dy)

    def stored() -> None:
        F.linear(x, fused_w).backward(dy)

    flop = 6 * tokens * dim * sum(widths)
    out = {}
    for name, fn, params in (
        ("separate", separate, [x, *ws]),
        ("cat_per_call", cat_per_call, [x, *ws]),
        ("stored_fused", stored, [x, fused_w]),
    ):
        ms = bench_ms(fn, params, rep)
        out[name] = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1)}
    for name in ("cat_per_call", "stored_fused"):
        out[f"{name}_speedup"] = round(out["separate"]["ms"] / out[name]["ms"], 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/projection_fusion.json")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--rep", type=int, default=300, help="do_bench time budget per case, ms")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    presets = ["small"] if args.small else ["1b", "3b"]
    tokens = [32] if args.small else args.tokens
    rows = []
    for preset in presets:
        dim, q, kv, ffn = PRESETS[preset]
        for t in tokens:
            for name, widths in (("qkv", [q, kv, kv]), ("gate_up", [ffn, ffn])):
                r = {"preset": preset, "tokens": t, "group": name, **group(dim, widths, t, args.rep)}
                print(json.dumps(r), flush=True)
                rows.append(r)
    res = {"command": "python3 " + " ".join(sys.argv), **versions(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
