"""``primus benchmark attention``: every attention provider in core's registry that is available here, through
the op's call contract (``attention(q, k, v, causal=True)``, q ``[b, h, s, d]``, k/v ``[b, h_kv, s, d]``), timed
interleaved (forward, and forward + backward), medians reported as TF/s.

FLOPs (causal, the usual convention): forward ``4·b·h·s²·d / 2``; backward 2.5× the forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from primus.tune.bench import interleaved_medians

if TYPE_CHECKING:
    from primus.core.contracts.plugins import Registry


def attention_flops(batch: int, seq: int, heads: int, head_dim: int, causal: bool = True) -> float:
    return 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)


def benchmark_providers(
    *,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    repeats: int,
    platform: str,
    registry: Registry,
) -> list[dict[str, Any]]:
    """One row per attention provider of ``registry`` (the CLI's): its TF/s, or why it was not timed."""
    device = "cpu" if platform == "cpu" else "cuda"
    dt = getattr(torch, dtype)
    q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dt, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=dt, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=dt, requires_grad=True)
    grad = torch.randn_like(q)
    fwd_flops = attention_flops(batch, seq, heads, head_dim)
    rows = []
    for prov in registry.providers("attention"):
        row: dict[str, Any] = {"provider": prov.name, "package": prov.dist, "note": ""}
        ok = prov.check(platform, head_dim=head_dim, dtype={"bfloat16": "bf16", "float16": "fp16"}.get(dtype, "fp32"))
        if not ok:
            row["note"] = f"not available: {ok.reason}"
            rows.append(row)
            continue
        try:
            fn = prov.load()

            def fwd(fn=fn):
                with torch.no_grad():
                    return fn(q, k, v, causal=True)

            def fwd_bwd(fn=fn):
                out = fn(q, k, v, causal=True)
                torch.autograd.grad(out, (q, k, v), grad)

            ms = interleaved_medians({"fwd": fwd, "fwd_bwd": fwd_bwd}, device=device, repeats=repeats, inner=2)
            row["fwd_ms"], row["fwd_bwd_ms"] = ms["fwd"], ms["fwd_bwd"]
            row["fwd_tflops"] = fwd_flops / (ms["fwd"] * 1e-3) / 1e12
            row["fwd_bwd_tflops"] = 3.5 * fwd_flops / (ms["fwd_bwd"] * 1e-3) / 1e12
        except Exception as exc:  # one failing provider does not end the benchmark
            row["note"] = f"failed: {type(exc).__name__}: {exc}"
        rows.append(row)
    return rows
