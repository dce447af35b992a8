"""Triton fp8 quantization (CUDA): the kernels behind :func:`primus.turbo.fp8.quantize.quantize`.

Same arithmetic as the PyTorch path: ``scale = fp8_max / max(amax, eps)``, saturating cast with
round-to-nearest-even, NaN inputs counted as an infinite amax (so ``scale_inv`` becomes NaN; the
atomic max that reduces tensorwise amax is not defined for NaN). Values are rounded onto the fp8 grid in fp32
(:func:`to_fp8`) before the cast: Triton's interpreter mis-rounds casts that carry into the next binade or tie, so
the kernels run on CPU (tests) give torch's bytes; on a GPU the cast of an fp8 value is exact (a few ALU ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus.turbo.fp8.recipe import FP8_MAX
from primus.turbo.fp8.scaling import AMAX_EPS, DTYPES, Quantized, scale_inv_from_amax

ROW_BLOCK = 1024  # columns per loop step of the rowwise kernel
FLAT_BLOCK = 4096  # elements per program of the tensorwise kernels


# mantissa bits and smallest normal exponent (torch 2.13's finfo gives e5m2fnuz 3 mantissa bits)
_GRID = {"e4m3": (3, -6), "e5m2": (2, -14), "e4m3fnuz": (3, -7), "e5m2fnuz": (2, -15)}


def fp8_grid(fmt: str) -> dict[str, int]:
    """:func:`to_fp8`'s constexprs for ``fmt``: mantissa bits and the smallest normal exponent."""
    mant, emin = _GRID[fmt]
    return {"MANT": mant, "EMIN": emin}


@triton.jit
def abs_nan_as_inf(x):
    return tl.where(x != x, float("inf"), tl.abs(x))


@triton.jit
def to_fp8(x, dtype: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """fp32 ``x`` (already clamped to ±fp8_max) rounded to nearest-even on the fp8 grid, then cast: adding
    2^(e + 23 - MANT) (e: x's exponent, at least EMIN for subnormals) makes fp32's own rounding drop all but MANT
    mantissa bits; non-finite values pass through. The fnuz formats have no -0 (its byte is their NaN)."""
    a = tl.abs(x)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, EMIN + 127)
    magic = ((e + 23 - MANT) << 23).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    if dtype == tl.float8e4b8 or dtype == tl.float8e5b16:
        r = tl.where(a < float("inf"), tl.where((x < 0) & (r > 0), -r, r), x)
    else:
        r = tl.where(a < float("inf"), tl.where(x < 0, -r, r), x)
    return r.to(dtype)


@triton.jit
def _rowwise_kernel(
    x_ptr,
    q_ptr,
    amax_ptr,
    n_cols,
    FMAX: tl.constexpr,
    EPS: tl.constexpr,
    BLOCK: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, abs_nan_as_inf(x))
    a = tl.max(amax, axis=0)
    scale = tl.where(a < float("inf"), FMAX / tl.maximum(a, EPS), 1.0)
    tl.store(amax_ptr + row, a)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        q = tl.clamp(x * scale, -FMAX, FMAX)
        tl.store(q_ptr + base + cols, to_fp8(q, q_ptr.dtype.element_ty, MANT, EMIN), mask=cols < n_cols)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(abs_nan_as_inf(x), axis=0))


@triton.jit
def _cast_kernel(
    x_ptr,
    q_ptr,
    scale_amax_ptr,
    own_amax_ptr,
    n,
    FMAX: tl.constexpr,
    EPS: tl.constexpr,
    REDUCE_OWN: tl.constexpr,
    BLOCK: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    a = tl.load(scale_amax_ptr)
    scale = tl.where(a < float("inf"), FMAX / tl.maximum(a, EPS), 1.0)
    q = tl.clamp(x * scale, -FMAX, FMAX)
    tl.store(q_ptr + offs, to_fp8(q, q_ptr.dtype.element_ty, MANT, EMIN), mask=offs < n)
    if REDUCE_OWN:  # delayed scaling: this step's amax for the history, in the same pass
        tl.atomic_max(own_amax_ptr, tl.max(abs_nan_as_inf(x), axis=0))


def quantize(x: torch.Tensor, fmt: str, *, rowwise: bool, amax: torch.Tensor | None = None) -> Quantized:
    rows, cols = x.shape
    q = torch.empty_like(x, dtype=DTYPES[fmt])
    fmax = FP8_MAX[fmt]
    if rowwise:
        own = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
        if x.numel():
            _rowwise_kernel[(rows,)](
                x, q, own, cols, FMAX=fmax, EPS=AMAX_EPS, BLOCK=ROW_BLOCK, num_warps=4, **fp8_grid(fmt)
            )
        return Quantized(q, scale_inv_from_amax(own, fmt), own)
    n = x.numel()
    grid = (triton.cdiv(n, FLAT_BLOCK),)
    own = torch.zeros((), device=x.device, dtype=torch.float32)
    if amax is None:
        if n:
            _amax_kernel[grid](x, own, n, BLOCK=FLAT_BLOCK, num_warps=8)
        scale_amax = own
    else:
        scale_amax = amax.float().reshape(())
    if n:
        _cast_kernel[grid](
            x,
            q,
            scale_amax,
            own,
            n,
            FMAX=fmax,
            EPS=AMAX_EPS,
            REDUCE_OWN=amax is not None,
            BLOCK=FLAT_BLOCK,
            num_warps=8,
            **fp8_grid(fmt),
        )
    return Quantized(q, scale_inv_from_amax(scale_amax, fmt), own)
