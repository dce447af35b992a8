"""Where the FP8 grouped GEMM's time goes: the GPU kernels of one forward + backward of the experts' gate + up GEMM
(the shapes of ``moe_kernels_h200.py``), bf16 ``grouped_mm`` against primus-turbo's FP8 (rowwise, tensorwise),
summed by kernel, so that what the quantisation costs (the weights' amax and casts, the activations', the wgrad's
jagged transposed copies) stands beside what the FP8 GEMMs save.

    python3 benchmarks/fp8_grouped_breakdown.py --out benchmarks/results/fp8_grouped_breakdown_h100.json
    python3 benchmarks/fp8_grouped_breakdown.py --out /tmp/smoke.json --smoke     # CPU: the code, no speed

Per shape and variant: ``gpu_ms`` (all kernels of one call), ``gemm_ms`` (the GEMM kernels alone), ``weight_ms`` (the
kernels that quantise the expert weights: what a weight cache across micro-batches would save), ``host_ms`` and
``by_kernel`` (ms per kernel name, largest first), ``gemms_ms`` (each GEMM kernel of one call, in launch order).
"""

from __future__ import annotations

import functools
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import kernel_args, versions  # noqa: E402
from fp8_linear_overhead import profile_calls  # noqa: E402
from moe_kernels_h200 import SHAPES  # noqa: E402

GEMM_KERNELS = ("gemm", "cutlass", "sm90", "xmma", "nvjet", "grouped_mm")


def is_gemm(name: str) -> bool:
    # (torch's prepare_grouped_gemm_data sets up the groups' pointers: not a GEMM)
    return any(g in name.lower() for g in GEMM_KERNELS) and "prepare_grouped" not in name


WEIGHT_KERNELS = ("_weight_amax_kernel", "_weight_cast_kernel")


def main() -> None:
    args = kernel_args(__doc__, "one tiny shape, 1 call", calls=10)
    from primus.core.kernels.fp8_recipe import Fp8Recipe
    from primus.turbo.fp8.grouped import grouped_gemm_for
    from primus.turbo.grouped_gemm import grouped_gemm

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = {"smoke": (64, 128, 8, 2, 64)} if args.smoke else SHAPES
    calls = 1 if args.smoke else args.calls
    impl = "triton" if dev.type == "cuda" or args.smoke else "torch"
    variants = {
        "bf16": grouped_gemm,
        **{
            f"fp8_{m}": functools.partial(grouped_gemm_for(Fp8Recipe(mode=m)), impl=impl)
            for m in ("rowwise", "tensorwise")
        },
    }
    result = {"command": " ".join(["python3", *sys.argv]), "versions": versions(), "rows": []}
    for name, (tokens, d, experts, k, ffn) in shapes.items():
        torch.manual_seed(0)
        indices = torch.randn(tokens, experts, device=dev).topk(k, dim=1).indices
        offs = torch.bincount(indices.reshape(-1), minlength=experts).cumsum(0).to(torch.int32)
        x = torch.randn(tokens * k, d, device=dev, dtype=torch.bfloat16).requires_grad_()
        w = (torch.randn(experts, 2 * ffn, d, device=dev) / d**0.5).to(torch.bfloat16).requires_grad_()
        g = torch.randn(tokens * k, 2 * ffn, device=dev, dtype=torch.bfloat16)
        for label, fn in variants.items():

            def step(fn=fn, x=x, w=w, g=g, offs=offs):
                return torch.autograd.grad(fn(x, w, offs), (x, w), g)

            gpu_ms, host_ms, kernels, _ = profile_calls(step, calls)
            by = defaultdict(float)
            for kname, us in kernels:
                by[kname[:120]] += us / 1e3
            gemm = sum(v for kk, v in by.items() if is_gemm(kk))
            weight = sum(v for kk, v in by.items() if any(s in kk for s in WEIGHT_KERNELS))
            row = {"shape": name, "rows": tokens * k, "d": d, "experts": experts, "n": 2 * ffn, "variant": label}
            row |= {"gpu_ms": round(gpu_ms, 4), "gemm_ms": round(gemm, 4), "weight_ms": round(weight, 4)}
            row |= {"host_ms": round(host_ms, 4)}
            # each GEMM kernel of one call in launch order (forward, then the backward's: FP8 dgrad before wgrad)
            row["gemms_ms"] = [round(us / 1e3, 4) for kname, us in kernels if is_gemm(kname)]
            row["by_kernel"] = {kk: round(v, 4) for kk, v in sorted(by.items(), key=lambda kv: -kv[1])}
            print(json.dumps({kk: v for kk, v in row.items() if kk != "by_kernel"}), flush=True)
            result["rows"].append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
