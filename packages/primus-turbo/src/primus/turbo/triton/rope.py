"""Rotary position embedding, rotate-half layout (GPT-NeoX / HF / Megatron non-interleaved), in Triton.

``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, i.e. for the two halves
``out1 = x1*cos1 - x2*sin1``, ``out2 = x2*cos2 + x1*sin2``. The backward is the transposed rotation:
``dx1 = dy1*cos1 + dy2*sin2``, ``dx2 = dy2*cos2 - dy1*sin1`` -- the same kernel with the sin halves swapped
and negated. One program per (batch, position) and block of heads: the position's cos/sin row is read
once and reused for every head. x may be a strided view (e.g. a slice of a fused qkv projection) as
long as its last dim is contiguous; the output is a new contiguous ``[b, s, h, d]`` tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 1024
NUM_WARPS = 4


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, seq_len, n_heads, half,
    stride_xb, stride_xs, stride_xh, stride_cs,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // seq_len
    s = pid % seq_len
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < half
    cs = s.to(tl.int64) * stride_cs
    cos1 = tl.load(cos_ptr + cs + dims, mask=dmask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + cs + half + dims, mask=dmask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs + dims, mask=dmask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + cs + half + dims, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of the rotation
        sin1, sin2 = -sin2, -sin1
    mask = (heads[:, None] < n_heads) & dmask[None, :]
    x_offs = b.to(tl.int64) * stride_xb + s.to(tl.int64) * stride_xs + heads[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offs + half, mask=mask, other=0.0).to(tl.float32)
    # the output is contiguous [b, s, h, d]
    o_offs = pid.to(tl.int64) * n_heads * 2 * half + heads[:, None] * 2 * half + dims[None, :]
    out1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    out2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    tl.store(out_ptr + o_offs, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + o_offs + half, out2.to(out_ptr.dtype.element_ty), mask=mask)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    bsz, seq, heads, dim = x.shape
    out = torch.empty((bsz, seq, heads, dim), dtype=x.dtype, device=x.device)
    half = dim // 2
    block_d = triton.next_power_of_2(half)
    # A tile of up to 1024 elements per half, 8 per thread (16-byte accesses in bf16): fewer warps for few heads.
    block_h = min(triton.next_power_of_2(heads), max(1, TILE // block_d))
    warps = max(1, min(NUM_WARPS, block_h * block_d // 256))
    _rope_kernel[(bsz * seq, triton.cdiv(heads, block_h))](
        x, cos, sin, out, seq, heads, half, x.stride(0), x.stride(1), x.stride(2), cos.stride(0),
        BLOCK_H=block_h, BLOCK_D=block_d, BACKWARD=backward, num_warps=warps,
    )  # fmt: skip
    return out


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] % 2:
            raise ValueError(f"rope: x must be [b, s, h, d] with an even d (got {tuple(x.shape)})")
        want = (x.shape[1], x.shape[-1])
        if tuple(cos.shape) != want or tuple(sin.shape) != want:
            raise ValueError(f"rope: cos/sin must be [s, d] = {list(want)} (got {list(cos.shape)}, {list(sin.shape)})")
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _apply(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _apply(dy, cos, sin, backward=True), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (core's ``rope`` contract): x ``[b, s, h, d]``, cos/sin ``[s, d]``; math in fp32,
    the result in ``x.dtype``. cos/sin get no gradient (they are position tables, not parameters)."""
    return RoPEFunction.apply(x, cos, sin)
