"""Document-aware attention (``data.document_mask``) on one GPU: fwd + bwd time and error of the two providers that
mask by document, against unmasked causal cuDNN attention (the speed the mask is paid against).

Shapes: batch 1, 32 query heads, 8 K/V heads (GQA), head_dim 128, bf16, seq 8192 and 32768 (``--seqs``). Document
lengths are drawn from an exponential distribution of mean ``--mean-doc`` tokens (seeded), ended by an EOS token;
the document ids come from core's ``document_ids`` as in a run.

Cases (the same bf16 inputs and output gradient):

``cudnn_causal``   ``F.scaled_dot_product_attention(is_causal=True)`` under the cuDNN backend: no document mask
                   (different attention; its error is against the causal reference)
``sdpa_documents`` core's ``sdpa`` provider with ``documents=``: a dense boolean ``[b, 1, s, s]`` mask (torch picks
                   the memory-efficient kernel), the mask built inside the timed call as in a run
``flex_documents`` primus-turbo's ``flex`` provider (FlexAttention compiled by Inductor to Triton) with
                   ``documents=``; its block mask is built once per micro-batch (timed separately as
                   ``block_mask_ms``: a run pays it once per micro-batch, not per layer)
``flex_causal``    the same provider's kernel with a plain causal block mask, for the cost of FlexAttention itself

Error: output and dq / dk / dv against an fp32 reference (explicit matmuls per document and K/V head group, no
TF32) from the same bf16 inputs: max abs error / max |ref| and ||x - ref|| / ||ref||.

Run (one H200): ``PYTHONPATH=packages/primus-core/src:packages/primus-turbo/src python3
benchmarks/document_attention_h200.py --out X.json`` (primus.core needs pluggy and pydantic importable).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from primus.core.kernels import reference
from primus.core.kernels.documents import document_ids
from primus.turbo import attention_flex

sys.path.insert(0, os.path.dirname(__file__))
from _common import clear_grads as _clear  # noqa: E402
from _common import time_autograd  # noqa: E402

B, HQ, HKV, D = 1, 32, 8, 128
DTYPE = torch.bfloat16
EOS = 0


def tokens_with_documents(s: int, mean: float, gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """``[1, s]`` token ids whose EOS tokens end documents of exponential lengths (mean ``mean``)."""
    tokens = torch.randint(1, 32000, (1, s), generator=gen)
    lengths, pos = [], 0
    while pos < s:
        n = max(1, int(torch.empty(1).exponential_(1 / mean, generator=gen).item()))
        n = min(n, s - pos)
        lengths.append(n)
        pos += n
        tokens[0, pos - 1] = EOS
    return tokens, lengths


def reference_fp32(q, k, v, dout, docs: torch.Tensor | None):
    """fp32 output and gradients, explicit math, one query head and one document (or the whole sequence, causal)
    at a time, each backward run at once (a 32k causal head is a 4 GiB score matrix)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    s = q.shape[2]
    bounds = [(0, s)]
    if docs is not None:
        ids = docs[0].tolist()
        starts = [0] + [i for i in range(1, s) if ids[i] != ids[i - 1]]
        bounds = list(zip(starts, starts[1:] + [s], strict=True))
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in (q, k, v))
    try:
        for h in range(HQ):
            g = h // (HQ // HKV)
            for a, b in bounds:
                qq = q[:, h, a:b].detach().float().requires_grad_()
                kk = k[:, g, a:b].detach().float().requires_grad_()
                vv = v[:, g, a:b].detach().float().requires_grad_()
                n = b - a
                scores = qq @ kk.transpose(-1, -2) / D**0.5
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
                o = scores.masked_fill(mask, float("-inf")).softmax(-1) @ vv
                o.backward(dout[:, h, a:b].float())
                out[:, h, a:b] = o.detach()
                dq[:, h, a:b] = qq.grad
                dk[:, g, a:b] += kk.grad
                dv[:, g, a:b] += vv.grad
                del scores, mask, o
        return [out, dq, dk, dv]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, Any]:
    out = {}
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        x = x.float()
        out[name] = {
            "max_abs_over_max_ref": ((x - r).abs().max() / r.abs().max()).item(),
            "rel_l2": ((x - r).norm() / r.norm()).item(),
        }
    return out


def run_case(fn, q, k, v, dout, ref, warmup, iters) -> dict[str, Any]:
    inputs = [q, k, v]
    _clear(inputs)
    out = fn(q, k, v)
    out.backward(dout)
    result = {"error": errors([out.detach(), q.grad, k.grad, v.grad], ref)}
    result |= time_autograd(fn, inputs, dout, warmup, iters)
    torch.cuda.reset_peak_memory_stats()
    _clear(inputs)
    fn(q, k, v).backward(dout)
    result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def bench_seq(s: int, mean_doc: float, warmup: int, iters: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(s)
    tokens, lengths = tokens_with_documents(s, mean_doc, gen)
    docs = document_ids(tokens, EOS).cuda()
    q = torch.randn(B, HQ, s, D, generator=gen).to("cuda", DTYPE).requires_grad_()
    k = torch.randn(B, HKV, s, D, generator=gen).to("cuda", DTYPE).requires_grad_()
    v = torch.randn(B, HKV, s, D, generator=gen).to("cuda", DTYPE).requires_grad_()
    dout = torch.randn(B, HQ, s, D, generator=gen).to("cuda", DTYPE)
    ref_docs = reference_fp32(q, k, v, dout, docs)
    ref_causal = reference_fp32(q, k, v, dout, None)
    row: dict[str, Any] = {
        "seq": s,
        "documents": len(lengths),
        "mean_document": statistics.mean(lengths),
        "longest_document": max(lengths),
        "cases": {},
    }

    def cudnn(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    cases = {
        "cudnn_causal": (cudnn, ref_causal),
        "sdpa_documents": (lambda q, k, v: reference.attention(q, k, v, documents=docs), ref_docs),
        "flex_documents": (lambda q, k, v: attention_flex.attention(q, k, v, documents=docs), ref_docs),
        "flex_causal": (lambda q, k, v: attention_flex.attention(q, k, v), ref_causal),
    }
    for name, (fn, ref) in cases.items():
        try:
            row["cases"][name] = run_case(fn, q, k, v, dout, ref, warmup, iters)
        except Exception as exc:  # a backend that refuses this shape: recorded, the others still run
            row["cases"][name] = {
                "failed": f"{type(exc).__name__}: {exc}"[:500],
                "trace": traceback.format_exc()[-2000:],
            }
        torch.cuda.empty_cache()
    # the block mask a run builds once per micro-batch (a fresh documents tensor: no cache hit)
    times = []
    for _ in range(5):
        fresh = docs.clone()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        attention_flex.block_mask(fresh, s, fresh.device)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    row["block_mask_ms"] = statistics.median(times[1:])
    base = row["cases"].get("cudnn_causal", {}).get("fwd_bwd_ms")
    for case in row["cases"].values():
        if base and "fwd_bwd_ms" in case:
            case["fwd_bwd_vs_cudnn_causal"] = case["fwd_bwd_ms"] / base
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--mean-doc", type=float, default=1024.0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = {
        "command": " ".join(sys.argv),
        "host": platform.node(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "shape": {"batch": B, "q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": str(DTYPE)},
        "rows": [bench_seq(s, args.mean_doc, args.warmup, args.iters) for s in args.seqs],
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for row in result["rows"]:
        print(row["seq"], row["documents"], "docs", f"block mask {row['block_mask_ms']:.2f} ms")
        for name, case in row["cases"].items():
            if "failed" in case:
                print(f"  {name}: {case['failed'][:200]}")
                continue
            err = max(e["max_abs_over_max_ref"] for e in case["error"].values())
            print(f"  {name}: {case['fwd_bwd_ms']:.2f} ms fwd+bwd ({case.get('fwd_bwd_vs_cudnn_causal', 0):.2f}x), "
                  f"max err {err:.2e}, peak {case['peak_memory_gib']:.1f} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
