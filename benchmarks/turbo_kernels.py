"""primus-turbo's Triton kernels against core's plain-PyTorch references on one GPU.

    python benchmarks/turbo_kernels.py --out benchmarks/results/turbo_kernels.json

Shapes are Llama-3.2-1B-like, 8192 tokens (``--tokens``, as ``--batch`` x seq): d 2048, ffn 8192, 32 heads
of 64, vocab 128256. For each kernel -- rms_norm, add_rms_norm, swiglu, swiglu_packed (on one [tokens, 2 x ffn]
input, also against the chunked kernel), rope, cross_entropy, and the fused linear_cross_entropy -- in bf16:

- correctness: the Triton result and gradients against core's reference run in fp32 on the same
  (bf16-rounded) inputs; max |error| / max |reference| per tensor, finite or not, within the bound or not;
- time (``triton.testing.do_bench``, median ms) of forward and of forward + backward, for the Triton
  kernel, the eager reference and ``torch.compile`` of the reference (``--no-compile`` skips it), and the
  speed ratios reference / Triton;
- GB/s for the memory-bound ops (bytes a fused kernel must move, over its time); TFLOP/s and peak memory
  above the inputs for linear cross-entropy against ``F.linear`` + cross-entropy (core's fp32 reference
  and torch's bf16 ``F.cross_entropy``).

Each kernel runs in its own ``try``: a failure is recorded in the JSON (``error``, traceback) and the
rest go on. ``--small`` runs tiny shapes, on CPU through Triton's interpreter when there is no GPU (a
check of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():  # --small on a CPU: the kernels run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from primus.core.kernels import reference  # noqa: E402
from primus.turbo.triton import cross_entropy, linear_cross_entropy, rms_norm, rope, swiglu  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _common import bench_ms  # noqa: E402

BF16_BOUND = 2e-2  # max |triton(bf16) - reference(fp32)| / max |reference|, per output and gradient
GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")


def errors(actual: list[torch.Tensor], expected: list[torch.Tensor], names: list[str]) -> dict:
    out = {}
    for name, a, e in zip(names, actual, expected, strict=True):
        a, e = a.float(), e.float()
        finite = bool(torch.isfinite(a).all())
        rel = ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item() if finite else float("inf")
        out[name] = {"finite": finite, "max_rel_err": rel, "ok": finite and rel <= BF16_BOUND}
    return out


def leaf(shape, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(shape, device=DEVICE) * scale).to(dtype).requires_grad_()


def fp32_copies(tensors):
    """fp32 leaves holding the same values (integer tensors, e.g. targets, pass through)."""
    return [t.detach().float().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in tensors]


def run_case(
    fn: Callable,
    ref: Callable,
    inputs: list[torch.Tensor],
    extra: tuple,
    bytes_fwd: int,
    bytes_bwd: int,
    args,
    others: dict[str, Callable] | None = None,
) -> dict:
    """Correctness (bf16 kernel vs fp32 reference) and timings of one op whose first output is the result;
    ``others``: more variants timed against the Triton kernel."""
    differentiable = [t for t in inputs if t.requires_grad]

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    out = fn(*inputs, *extra)
    grad_out = torch.randn_like(first(out)) if first(out).dim() else torch.ones_like(first(out))
    first(out).backward(grad_out)
    grads = [t.grad for t in differentiable]
    for t in differentiable:
        t.grad = None
    ref_inputs = fp32_copies(inputs)
    ref_out = ref(*ref_inputs, *extra)
    first(ref_out).backward(grad_out.float())
    names = ["out"] + [f"grad{i}" for i in range(len(grads))]
    result = {
        "correctness": errors(
            [first(out), *grads], [first(ref_out)] + [t.grad for t in ref_inputs if t.requires_grad], names
        )
    }

    def fwd_bwd(f):
        return lambda: first(f(*inputs, *extra)).backward(grad_out)

    variants = {"triton": fn, "torch": ref, **(others or {})}
    if args.compile:
        variants["torch_compile"] = torch.compile(ref)
    for name, f in variants.items():
        try:
            with torch.no_grad():
                fwd = bench_ms(lambda f=f: f(*inputs, *extra), [], args.rep)
            both = bench_ms(fwd_bwd(f), differentiable, args.rep)
            result[name] = {"fwd_ms": fwd, "fwd_bwd_ms": both}
        except Exception as exc:  # a compile failure must not hide the other numbers
            result[name] = {"error": repr(exc), "traceback": traceback.format_exc(limit=4)}
    t = result.get("triton", {})
    if "fwd_ms" in t:
        t["fwd_GBps"] = bytes_fwd / t["fwd_ms"] / 1e6
        t["fwd_bwd_GBps"] = (bytes_fwd + bytes_bwd) / t["fwd_bwd_ms"] / 1e6
        for name in [v for v in variants if v != "triton"]:
            if "fwd_ms" in result.get(name, {}):
                result[f"speedup_vs_{name}"] = {
                    "fwd": result[name]["fwd_ms"] / t["fwd_ms"],
                    "fwd_bwd": result[name]["fwd_bwd_ms"] / t["fwd_bwd_ms"],
                }
    return result


def peak_extra_gib(fn: Callable[[], object]) -> float | None:
    """Peak memory allocated while ``fn`` runs, above what was allocated before (GiB)."""
    if not GPU:
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def linear_ce_case(n: int, d: int, vocab: int, args) -> dict:
    hidden, weight = leaf((n, d)), leaf((vocab, d), scale=d**-0.5)
    target = torch.randint(0, vocab, (n,), device=DEVICE)
    target[::17] = -100

    variants = {
        "triton_fused": lambda h, w: linear_cross_entropy.linear_cross_entropy(h, w, target),
        "linear+reference_ce": lambda h, w: reference.cross_entropy(F.linear(h, w), target),  # fp32 upcast
        "linear+F.cross_entropy_bf16": lambda h, w: F.cross_entropy(F.linear(h, w), target),
    }
    if args.compile:
        variants["torch_compile(linear+reference_ce)"] = torch.compile(variants["linear+reference_ce"])

    loss = variants["triton_fused"](hidden, weight)
    loss.backward()
    got = [loss, hidden.grad, weight.grad]
    hidden.grad = weight.grad = None
    h32, w32 = fp32_copies([hidden, weight])
    ref = reference.cross_entropy(h32 @ w32.T, target)
    ref.backward()
    result = {
        "correctness": errors(got, [ref, h32.grad, w32.grad], ["loss", "grad_hidden", "grad_weight"]),
        "chunk_tokens": linear_cross_entropy.default_chunk_size(n, vocab, hidden.element_size()),
    }
    del h32, w32, ref, got
    flops = 6 * n * d * vocab  # forward GEMM + two backward GEMMs
    for name, f in variants.items():
        try:

            def step(f=f):
                f(hidden, weight).backward()
                hidden.grad = weight.grad = None

            ms = bench_ms(step, [hidden, weight], args.rep)
            result[name] = {"fwd_bwd_ms": ms, "TFLOPps": flops / ms / 1e9, "peak_extra_GiB": peak_extra_gib(step)}
        except Exception as exc:  # e.g. out of memory for the unfused path
            result[name] = {"error": repr(exc), "traceback": traceback.format_exc(limit=4)}
        if GPU:
            torch.cuda.empty_cache()
    fused = result.get("triton_fused", {})
    for name in variants:
        if name != "triton_fused" and "fwd_bwd_ms" in result.get(name, {}) and "fwd_bwd_ms" in fused:
            result[f"speedup_vs_{name}"] = result[name]["fwd_bwd_ms"] / fused["fwd_bwd_ms"]
            if fused["peak_extra_GiB"]:
                result[f"memory_saving_vs_{name}"] = result[name]["peak_extra_GiB"] / fused["peak_extra_GiB"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("turbo_kernels.json"))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2, help="rope's x is [batch, tokens/batch, heads, head_dim]")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rep", type=int, default=200, help="do_bench time budget per measurement, ms")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile variants")
    parser.add_argument("--only", nargs="*", help="run only these kernels")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a check of this script")
    args = parser.parse_args()
    if args.small:
        args.tokens, args.batch, args.dim, args.ffn, args.vocab, args.heads = 64, 2, 96, 160, 1000, 4
        args.compile = args.compile and GPU

    n, d, ffn, vocab, h, hd = args.tokens, args.dim, args.ffn, args.vocab, args.heads, args.head_dim
    seq = n // args.batch
    torch.manual_seed(0)
    e = 2  # bf16 bytes
    angles = torch.outer(
        torch.arange(seq, device=DEVICE).float(), 500000.0 ** -(torch.arange(0, hd, 2) / hd).to(DEVICE)
    )
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    logits_target = torch.randint(0, vocab, (n,), device=DEVICE)
    logits_target[::17] = -100

    cases: dict[str, Callable[[], dict]] = {
        "rms_norm": lambda: run_case(
            rms_norm.rms_norm,
            reference.rms_norm,
            [leaf((n, d)), leaf((d,))],
            (1e-6,),
            2 * n * d * e,
            3 * n * d * e,
            args,
        ),
        "add_rms_norm": lambda: run_case(
            rms_norm.add_rms_norm,
            lambda x, r, w, eps: (reference.rms_norm(x + r, w, eps), x + r),
            [leaf((n, d)), leaf((n, d)), leaf((d,))],
            (1e-6,),
            4 * n * d * e,
            4 * n * d * e,
            args,
        ),
        "swiglu": lambda: run_case(
            swiglu.swiglu,
            reference.swiglu,
            [leaf((n, ffn)), leaf((n, ffn))],
            (),
            3 * n * ffn * e,
            5 * n * ffn * e,
            args,
        ),
        # megatron's fused fc1 output [n, 2 ffn]: the packed kernel against the chunked one, whose gradient
        # autograd's chunk backward concatenates
        "swiglu_packed": lambda: run_case(
            swiglu.swiglu_packed,
            lambda x: reference.swiglu(*x.chunk(2, -1)),
            [leaf((n, 2 * ffn))],
            (),
            3 * n * ffn * e,
            5 * n * ffn * e,
            args,
            others={"triton_chunked": lambda x: swiglu.swiglu(*x.chunk(2, -1))},
        ),
        "rope": lambda: run_case(
            rope.rope,
            reference.rope,
            [leaf((args.batch, seq, h, hd)), cos, sin],
            (),
            2 * n * h * hd * e,
            2 * n * h * hd * e,
            args,
        ),
        "cross_entropy": lambda: run_case(
            cross_entropy.cross_entropy,
            reference.cross_entropy,
            [leaf((n, vocab), scale=2.0), logits_target],
            (),
            n * vocab * e,
            2 * n * vocab * e,
            args,
        ),
        "linear_cross_entropy": lambda: linear_ce_case(n, d, vocab, args),
    }
    report = {
        "device": torch.cuda.get_device_name() if GPU else f"cpu ({platform.processor() or 'interpreter'})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "shapes": {"tokens": n, "batch": args.batch, "dim": d, "ffn": ffn, "vocab": vocab, "heads": h, "head_dim": hd},
        "dtype": "bf16",
        "correctness_bound": f"max|err|/max|ref| <= {BF16_BOUND} vs fp32 reference",
        "results": {},
    }
    for name, case in cases.items():
        if args.only and name not in args.only:
            continue
        start = time.time()
        try:
            report["results"][name] = case()
        except Exception as exc:
            report["results"][name] = {"error": repr(exc), "traceback": traceback.format_exc(limit=6)}
        report["results"][name]["wall_s"] = round(time.time() - start, 1)
        print(name, json.dumps(report["results"][name], default=str)[:600], flush=True)
        if GPU:
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
