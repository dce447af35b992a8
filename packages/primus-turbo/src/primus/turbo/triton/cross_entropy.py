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

The forward row kernel and its launcher :func:`ce_rows`, which the fused linear cross-entropy runs too, are
in :mod:`.cross_entropy_rows`; this module holds the plain op and its backward kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Re-exported (`as` itself): the forward kernel and its block cap stay importable from here.
from primus.turbo.triton.cross_entropy_rows import MAX_BLOCK_V as MAX_BLOCK_V
from primus.turbo.triton.cross_entropy_rows import _ce_fwd as _ce_fwd
from primus.turbo.triton.cross_entropy_rows import block_v, ce_rows, softmax_grad_row, valid_count
from primus.turbo.triton.launch import num_warps


@triton.jit
def _ce_bwd(
    x_ptr, stride_x, target_ptr, lse_ptr, scale_ptr, grad_ptr, stride_g, n_cols, ignore_index, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row).to(tl.int64)
    scale = tl.where(target != ignore_index, tl.load(scale_ptr), 0.0)
    lse = tl.load(lse_ptr + row)
    softmax_grad_row(x_ptr + row * stride_x, grad_ptr + row * stride_g, n_cols, lse, target, scale, BLOCK_V)


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
    # imported on first use (the fused op is a feature of this one, not needed to import it)
    from primus.turbo.triton.linear_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, target, ignore_index)


# The fused output projection + cross-entropy this provider offers (core's ``cross_entropy`` contract: an
# attribute of the op's callable), which the backends use in place of their output layer + loss.
cross_entropy.linear_cross_entropy = _linear_cross_entropy
