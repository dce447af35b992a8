"""Cross-entropy over rows of logits in Triton, and the plain-logits ``cross_entropy`` op.

One program per row streams the vocab in blocks of ``BLOCK_V``, keeping an online max and sum of
exponentials in fp32 (``m' = max(m, max(x)); s' = s*exp(m - m') + sum(exp(x - m'))``), so a row of any
length is read once for the loss with O(BLOCK_V) registers. Its per-row loss is ``lse - x[target]``
(0 for ``ignore_index``). The gradient ``(softmax(x) - onehot(target)) * scale`` is a second pass over
the row, from the kept ``lse``: in the plain op's backward, or (for the fused linear cross-entropy) in
the forward kernel itself, written over the logits in place. ``scale`` (``grad_out / n_valid``) is read
from device memory, so no step needs a host sync.

Mean over the non-ignored tokens, as ``F.cross_entropy``; where every token is ignored the loss is 0
with zero gradient (torch gives nan there: 0/0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus.turbo.triton.launch import num_warps

MAX_BLOCK_V = 8192


@triton.jit
def _softmax_grad_row(x_row, g_row, n_cols, lse, target, scale, BLOCK_V: tl.constexpr):
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
        _softmax_grad_row(x_row, grad_ptr + row * stride_g, n_cols, lse, target, scale, BLOCK_V)


@triton.jit
def _ce_bwd(
    x_ptr, stride_x, target_ptr, lse_ptr, scale_ptr, grad_ptr, stride_g, n_cols, ignore_index, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row).to(tl.int64)
    scale = tl.where(target != ignore_index, tl.load(scale_ptr), 0.0)
    lse = tl.load(lse_ptr + row)
    _softmax_grad_row(x_ptr + row * stride_x, grad_ptr + row * stride_g, n_cols, lse, target, scale, BLOCK_V)


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


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, block: int | None = None):
        x = logits.reshape(-1, logits.shape[-1])
        if x.stride(-1) != 1:
            x = x.contiguous()
        t = target.reshape(-1)
        if t.numel() != x.shape[0]:
            raise ValueError(f"cross_entropy: {t.numel()} targets for {x.shape[0]} rows of logits")
        loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        lse = torch.empty_like(loss)
        ce_rows(x, t, ignore_index, loss, lse, block=block)
        n_valid = valid_count(t, ignore_index)
        ctx.save_for_backward(x, t, lse, n_valid)
        ctx.ignore_index, ctx.block, ctx.shape = ignore_index, block or block_v(x.shape[1]), logits.shape
        return loss.sum() / n_valid

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, t, lse, n_valid = ctx.saved_tensors
        scale = (grad_out.float() / n_valid).reshape(1)
        grad = torch.empty_like(x)
        _ce_bwd[(x.shape[0],)](
            x, x.stride(0), t, lse, scale, grad, grad.stride(0), x.shape[1], ctx.ignore_index,
            BLOCK_V=ctx.block, num_warps=num_warps(ctx.block),
        )  # fmt: skip
        return grad.view(ctx.shape), None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``logits [..., V]`` against ``target [...]`` (core's ``cross_entropy``
    contract): fp32 math whatever the logits dtype, fp32 loss, gradient in the logits dtype."""
    return CrossEntropyFunction.apply(logits, target, ignore_index)


def _linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    # imported on first use: linear_cross_entropy imports this module's row kernel
    from primus.turbo.triton.linear_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, target, ignore_index)


# The fused output projection + cross-entropy this provider offers (core's ``cross_entropy`` contract: an
# attribute of the op's callable), which the backends use in place of their output layer + loss.
cross_entropy.linear_cross_entropy = _linear_cross_entropy
