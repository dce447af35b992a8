"""FP8 (rowwise e4m3) grouped GEMM against bf16 on the MoE experts' shapes: is an FP8 grouped-GEMM provider worth it?

    python3 benchmarks/fp8_grouped_gemm_h200.py --out benchmarks/results/fp8_grouped_gemm_h200.json

One GPU, forward GEMMs only (x [T, K] sorted by expert, w [E, N, K] as the experts store it): bf16
``torch._grouped_mm`` against ``torch._scaled_grouped_mm`` (sm90 / MI300+: e4m3 operands, fp32 scales per row of x
and per output column of each expert, bf16 out, fast accumulation), the latter with and without the rowwise casts it
needs (plain torch ops here; a fused cast kernel would sit between the two). Error: relative Frobenius error of each
against an fp32 loop over the experts. Shapes: Qwen3-30B-A3B's experts (128 of 2048 -> 2 x 768 and 768 -> 2048, top 8,
4096 tokens: 256 rows each) and Mixtral 8x7B's (8 of 4096 -> 2 x 14336 and 14336 -> 4096, top 2: 1024 rows each).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import versions  # noqa: E402

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
SHAPES = {  # name: (experts, rows per expert, K, N)
    "qwen3_fc1": (128, 256, 2048, 1536),
    "qwen3_fc2": (128, 256, 768, 2048),
    "mixtral_fc1": (8, 1024, 4096, 28672),
    "mixtral_fc2": (8, 1024, 14336, 4096),
}


def rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 of ``t`` scaled per row (last dim reduced) and the fp32 inverse scales (what the GEMM multiplies back)."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), (1 / scale).squeeze(-1)


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def case(name: str, iters: int) -> dict:
    e, rows, k, n = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(e * rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(e, n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    offs = torch.arange(rows, e * rows + 1, rows, device="cuda", dtype=torch.int32)
    ref = torch.cat([x[i * rows : (i + 1) * rows].float() @ w[i].float().t() for i in range(e)])

    def bf16():
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)

    xq, xs = rowwise(x)
    wq, ws = rowwise(w)  # per (expert, output column): w's rows

    def fp8_gemm():
        return torch._scaled_grouped_mm(
            xq, wq.transpose(-2, -1), xs, ws, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
        )

    def fp8_with_casts():
        a, sa = rowwise(x)
        b, sb = rowwise(w)
        return torch._scaled_grouped_mm(
            a, b.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
        )

    flops = 2 * e * rows * k * n
    out: dict = {"shape": {"experts": e, "rows_per_expert": rows, "K": k, "N": n}}
    for label, fn in (("bf16", bf16), ("fp8_gemm", fp8_gemm), ("fp8_with_casts", fp8_with_casts)):
        ms = timed(fn, iters)
        err = ((fn().float() - ref).norm() / ref.norm()).item()
        out[label] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "rel_error": err}
    out["speedup_gemm"] = out["bf16"]["ms"] / out["fp8_gemm"]["ms"]
    out["speedup_with_casts"] = out["bf16"]["ms"] / out["fp8_with_casts"]["ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    result = {"argv": sys.argv, "versions": versions(), "device": torch.cuda.get_device_name(), "cases": {}}
    for name in SHAPES:
        try:
            result["cases"][name] = case(name, args.iters)
        except Exception as exc:  # noqa: BLE001 - an unsupported shape or build is recorded, the others run
            result["cases"][name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        print(name, json.dumps(result["cases"][name]), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
