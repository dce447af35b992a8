"""SwiGLU ``silu(gate) * up`` as elementwise Triton kernels with a backward.

Forward reads gate and up once and writes the product (fp32 math, one rounding to the input dtype).
Backward recomputes ``sigmoid(gate)`` from the saved inputs instead of keeping ``silu(gate)``:
``d_up = dy * silu(g)``, ``d_gate = dy * up * s * (1 + g * (1 - s))`` with ``s = sigmoid(g)``.
Memory-bound: 3 tensors moved forward, 5 backward.

gate and up are taken as ``[rows, cols]`` with a row stride of their own, so the two halves of a fused
gate/up projection (``torch.chunk(fc1_out, 2, -1)``) are read in place, not copied. Their gradients come back
as two tensors, which autograd's chunk backward then concatenates: a copy of the whole [tokens, 2 x ffn]
gradient per layer. :func:`swiglu_packed` takes the fused projection's output itself and writes both halves'
gradients into one tensor of its layout, so there is no concatenation; megatron's MLP uses it
(``swiglu.packed``, an attribute of the op's callable as ``cross_entropy.linear_cross_entropy`` is).
Grid: (rows, column blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
NUM_WARPS = 8  # 8 bf16 (16 bytes) per thread and access


@triton.jit
def _swiglu_fwd(gate_ptr, up_ptr, out_ptr, n_cols, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(
    dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n_cols, stride_g, stride_u, stride_d, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)  # dy is contiguous
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    offs = row * stride_d + cols  # dgate and dup share a row stride (one tensor's halves, or two of one shape)
    tl.store(dup_ptr + offs, (dy * silu).to(dup_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + offs, (dy * u * (s + silu * (1.0 - s))).to(dgate_ptr.dtype.element_ty), mask=mask)


def _row_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, cols]`` with unit column stride: a view where the layout allows, else a copy."""
    if t.stride(-1) == 1:
        try:
            return t.view(-1, t.shape[-1])
        except RuntimeError:  # leading dims that do not merge into one row stride
            pass
    return t.contiguous().view(-1, t.shape[-1])


def _grid(rows: int, cols: int) -> tuple[int, int]:
    return rows, triton.cdiv(cols, BLOCK)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(
                f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ"
            )
        g, u = _row_view(gate), _row_view(up)
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        _swiglu_fwd[_grid(*g.shape)](g, u, out, g.shape[1], g.stride(0), u.stride(0), BLOCK=BLOCK, num_warps=NUM_WARPS)
        ctx.save_for_backward(g, u)
        ctx.shape = gate.shape
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        g, u = ctx.saved_tensors
        dgate = torch.empty(ctx.shape, dtype=g.dtype, device=g.device)
        dup = torch.empty_like(dgate)
        _backward(dy, g, u, dgate.view(-1, g.shape[1]), dup.view(-1, g.shape[1]))
        return dgate, dup


def _backward(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor, dgate: torch.Tensor, dup: torch.Tensor) -> None:
    """dgate, dup ``[rows, cols]`` of one row stride: two tensors, or the halves of one."""
    _swiglu_bwd[_grid(*g.shape)](
        dy.contiguous(), g, u, dgate, dup, g.shape[1], g.stride(0), u.stride(0), dgate.stride(0),
        BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip


class SwiGLUPackedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"swiglu_packed: the last dim ({x.shape[-1]}) holds gate and up halves: it must be even")
        rows = _row_view(x)
        n = x.shape[-1] // 2
        g, u = rows[:, :n], rows[:, n:]
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        _swiglu_fwd[_grid(*g.shape)](g, u, out, n, g.stride(0), u.stride(0), BLOCK=BLOCK, num_warps=NUM_WARPS)
        ctx.save_for_backward(rows)
        ctx.shape = x.shape
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (rows,) = ctx.saved_tensors
        n = rows.shape[1] // 2
        dx = torch.empty(ctx.shape, dtype=rows.dtype, device=rows.device)
        d = dx.view(-1, 2 * n)
        _backward(dy, rows[:, :n], rows[:, n:], d[:, :n], d[:, n:])
        return dx


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (core's ``swiglu`` contract); gate and up of one shape and dtype."""
    return SwiGLUFunction.apply(gate, up)


def swiglu_packed(x: torch.Tensor) -> torch.Tensor:
    """``swiglu(*x.chunk(2, -1))`` with the gradient written in ``x``'s layout: no concatenation in the backward."""
    return SwiGLUPackedFunction.apply(x)


swiglu.packed = swiglu_packed
