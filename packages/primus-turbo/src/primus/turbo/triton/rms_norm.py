"""RMSNorm, and RMSNorm fused with the residual add before it, as Triton kernels with a backward.

Forward: one program per row holds the whole row in registers (fp32), so x is read once and y written
once; it keeps the per-row ``rstd`` (fp32, 4 bytes a row) for the backward. The fused variant also writes
the residual sum ``h = x + residual`` (rounded to the input dtype, as the unfused ``x + residual`` is,
and normalised after rounding, so it matches the unfused pair bit for bit in the sum).

Backward: a persistent grid, each program walking rows ``pid, pid + P, ...``; per row
``dx = rstd * (w*dy - xhat * mean(w*dy*xhat))`` with ``xhat = x * rstd``, plus the incoming gradient of
``h`` in the fused variant. Each program sums ``dy * xhat`` for the weight gradient in registers and
writes one fp32 partial row; the ``P`` partials are summed by torch (no atomics: deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus.turbo.triton.launch import num_warps, program_count, rows

# A row is held in registers: beyond 64 KiB of it the kernel would spill.
MAX_ROW_BYTES = 65536


@triton.jit
def _rms_norm_fwd(x_ptr, res_ptr, sum_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if ADD:
        h = x.to(tl.float32) + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = h.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (xf * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dsum_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols, n_programs,
    BLOCK: tl.constexpr, ADD_GRAD: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(pid, n_rows, n_programs):
        offs = tl.cast(row, tl.int64) * n_cols + cols
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        wdy = w * dy
        dx = (wdy - xhat * (tl.sum(wdy * xhat, axis=0) / n_cols)) * rstd
        if ADD_GRAD:
            dx += tl.load(dsum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_part_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


def _block(x: torch.Tensor) -> int:
    block = triton.next_power_of_2(x.shape[-1])
    if block * x.element_size() > MAX_ROW_BYTES:
        raise ValueError(f"rms_norm: rows of {x.shape[-1]} {x.dtype} elements exceed {MAX_ROW_BYTES} bytes")
    return block


def _forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """x, residual: ``[rows, n]`` contiguous. Returns (y, residual sum or None, rstd)."""
    n_rows, n_cols = x.shape
    if weight.shape != (n_cols,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match the last dim {n_cols}")
    block = _block(x)
    y = torch.empty_like(x)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    h = torch.empty_like(x) if residual is not None else None
    _rms_norm_fwd[(n_rows,)](
        x, residual if residual is not None else x, h if h is not None else y, weight.contiguous(), y, rstd,
        n_cols, eps, BLOCK=block, ADD=residual is not None, num_warps=num_warps(block),
    )  # fmt: skip
    return y, h, rstd


def _backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dsum: torch.Tensor | None):
    n_rows, n_cols = x.shape
    block = _block(x)
    programs = min(n_rows, program_count(x.device))
    dx = torch.empty_like(x)
    dw_part = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
    _rms_norm_bwd[(programs,)](
        dy, x, weight, rstd, dsum if dsum is not None else dy, dx, dw_part, n_rows, n_cols, programs,
        BLOCK=block, ADD_GRAD=dsum is not None, num_warps=num_warps(block),
    )  # fmt: skip
    return dx, dw_part.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = rows(x)
        y, _, rstd = _forward(x2, None, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(rows(dy), x2, weight, rstd, None)
        return dx.view(dy.shape), dw if ctx.needs_input_grad[1] else None, None


class AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("add_rms_norm: x and residual must have the same shape and dtype")
        y, h, rstd = _forward(rows(x), rows(residual), weight, eps)
        ctx.save_for_backward(h, weight, rstd)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to read
        ctx.shape = x.shape
        return y.view(x.shape), h.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, dh: torch.Tensor | None):
        h, weight, rstd = ctx.saved_tensors
        if dy is None:  # only the residual sum was used downstream
            dy = torch.zeros_like(h)
        dx, dw = _backward(rows(dy), h, weight, rstd, rows(dh) if dh is not None else None)
        dx = dx.view(ctx.shape)
        return dx, dx, dw if ctx.needs_input_grad[2] else None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last dim, in fp32, returned in ``x.dtype``
    (core's ``rms_norm`` contract)."""
    return RMSNormFunction.apply(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual; return rms_norm(h, weight, eps), h`` in one pass over memory (pre-norm blocks
    add the sublayer output to the residual stream and normalise the sum for the next sublayer)."""
    return AddRMSNormFunction.apply(x, residual, weight, eps)
