"""The forward cross-entropy row kernel and its launcher :func:`ce_rows`, shared by the plain op
(:mod:`.cross_entropy`, which also holds its backward kernel) and the fused one (:mod:`.linear_cross_entropy`).
The algorithm (online logsumexp over vocab blocks, gradient from the kept ``lse``) is described in
:mod:`.cross_entropy`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus.turbo.triton.launch import num_warps

MAX_BLOCK_V = 8192


@triton.jit
def softmax_grad_row(x_row, g_row, n_cols, lse, target, scale, BLOCK_V: tl.constexpr):
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        g = tl.where(cols == target, p - 1.0, p) * scale
        tl.store(g_row + cols, g.to(g_row.dtype.element_ty), mask=mask)


@triton.jit
def _ce_fwd(
    x_ptr, stride_x, target_ptr, loss_ptr, lse_ptr, scale_ptr, grad_ptr, stride_g, n_cols, ignore_index,
    BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    target = tl.load(target_ptr + row).to(tl.int64)
    m = float("-inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    valid = target != ignore_index
    x_target = tl.load(x_row + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_target, 0.0))
    tl.store(lse_ptr + row, lse)
    if WRITE_GRAD:  # after every read of x_target: the gradient may overwrite x in place
        scale = tl.where(valid, tl.load(scale_ptr), 0.0)
        softmax_grad_row(x_row, grad_ptr + row * stride_g, n_cols, lse, target, scale, BLOCK_V)


def block_v(n_cols: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(n_cols))


def valid_count(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Non-ignored tokens as a device tensor, at least 1 (an all-ignored batch gives loss 0, not 0/0)."""
    return (target != ignore_index).sum().clamp_(min=1)


def ce_rows(
    x: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    loss: torch.Tensor,
    lse: torch.Tensor,
    grad_scale: torch.Tensor | None = None,
    block: int | None = None,
) -> None:
    """Per-row loss and lse of ``x [rows, V]`` (last dim contiguous) into ``loss``/``lse`` (fp32 [rows]).
    With ``grad_scale`` (an fp32 device tensor of one element) the gradient times it overwrites ``x``."""
    block = block or block_v(x.shape[1])
    write = grad_scale is not None
    _ce_fwd[(x.shape[0],)](
        x, x.stride(0), target, loss, lse, grad_scale if write else lse, x, x.stride(0), x.shape[1], ignore_index,
        BLOCK_V=block, WRITE_GRAD=write, num_warps=num_warps(block),
    )  # fmt: skip
