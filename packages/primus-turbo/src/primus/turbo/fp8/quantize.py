"""Quantize a 2-D tensor to fp8: amax → scale → saturating cast, one scale per tensor or per row.

``scale = fp8_max / amax`` maps the largest magnitude onto the format's largest finite value; the GEMM
gets ``scale_inv = amax / fp8_max`` (``torch._scaled_mm`` multiplies its result by both operands'
``scale_inv``). An all-zero tensor or row takes amax = :data:`AMAX_EPS` (zeros stay zeros).

Non-finite input: an inf or NaN makes the amax non-finite, and its ``scale_inv`` is set to NaN, so every
product that uses it is NaN. The alternative (a scale of 0 or a clamp to fp8_max) would give a finite,
wrong result that training would silently continue with; NaN reaches the loss / grad norm, where the
health checks see it.

Two implementations with the same arithmetic: PyTorch ops (anywhere) and Triton (CUDA): rowwise is one
kernel per row block (amax, scale and cast in one program, the row read twice from cache); tensorwise
needs the global amax first, so current scaling is an amax kernel then a cast kernel, and delayed scaling
(amax known from the history) a single cast kernel that also reduces this step's amax.
"""

from __future__ import annotations

from typing import Literal

import torch

from primus.turbo.fp8.recipe import FP8_MAX

# The pieces the Triton quantizer shares live in .scaling (imported by both), and stay importable from here.
from primus.turbo.fp8.scaling import AMAX_EPS, DTYPES, Quantized, scale_from_amax, scale_inv_from_amax  # noqa: F401

Impl = Literal["auto", "torch", "triton"]


def resolve_impl(x: torch.Tensor, impl: Impl) -> Impl:
    """``auto`` made concrete: Triton on CUDA in eager mode; under torch.compile the PyTorch ops, which
    inductor fuses into the neighbouring kernels (the norm or activation that produced ``x``, the transposed
    copy the backward needs) where the hand-written kernel would stay a separate launch and an extra pass.

    The FP8 linear resolves this once, in its forward, and hands the result to its backward, so both passes
    of one call use the same quantizer."""
    if impl != "auto":
        return impl
    return "triton" if x.is_cuda and not torch.compiler.is_compiling() else "torch"


def quantize(
    x: torch.Tensor, fmt: str, *, rowwise: bool, amax: torch.Tensor | None = None, impl: Impl = "auto"
) -> Quantized:
    """``x`` [rows, cols] to fp8 ``fmt`` (a key of :data:`DTYPES`). ``amax`` (tensorwise only) scales with a given
    amax (delayed scaling) instead of this tensor's own; values beyond it saturate at fp8_max."""
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D tensor (got shape {tuple(x.shape)})")
    if rowwise and amax is not None:
        raise ValueError("a given amax (delayed scaling) is per tensor; rowwise computes its own")
    if resolve_impl(x, impl) == "triton":
        from primus.turbo.fp8 import triton_quantize

        return triton_quantize.quantize(x.contiguous(), fmt, rowwise=rowwise, amax=amax)
    return quantize_torch(x, fmt, rowwise=rowwise, amax=amax)


def quantize_torch(x: torch.Tensor, fmt: str, *, rowwise: bool, amax: torch.Tensor | None = None) -> Quantized:
    xf = x.float()
    own = xf.abs().amax(dim=-1, keepdim=True) if rowwise else xf.abs().amax()
    scale_amax = own if amax is None else amax.float()
    fmax = FP8_MAX[fmt]
    data = (xf * scale_from_amax(scale_amax, fmt)).clamp(-fmax, fmax).to(DTYPES[fmt])
    return Quantized(data, scale_inv_from_amax(scale_amax, fmt), own)


def dequantize(q: Quantized) -> torch.Tensor:
    """fp32 values the fp8 tensor stands for (``data * scale_inv``): the emulation / test reference."""
    return q.data.float() * q.scale_inv
