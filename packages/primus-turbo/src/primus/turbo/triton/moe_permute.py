"""Mixture-of-experts token permute / unpermute as Triton row-gather kernels, each with its backward.

The contract is core's (:mod:`primus.core.kernels.selection`, ``moe_permute``): ``order`` is the stable sort of the token-expert
slots (slot ``t·k + j``) by expert, so the permuted row ``i`` is a copy of token ``order[i] // k``. Every direction is
a *gather* (each program reads the rows it needs and writes its own row once), so there are no atomics and the
results do not depend on scheduling:

- permute forward: ``routed[i] = x[order[i] // k]`` (:func:`_gather_rows`);
- permute backward: ``dx[t] = Σ_j d_routed[pos[t·k + j]]``, ``pos`` the inverse of ``order`` (:func:`_gather_sum`);
- unpermute forward: ``out[t] = Σ_j probs[t, j] · routed[pos[t·k + j]]``, fp32 accumulation (:func:`_gather_sum`);
- unpermute backward: ``d_routed[i] = probs[order[i]] · d_out[order[i] // k]`` (:func:`_gather_rows`) and
  ``d_probs[t, j] = <d_out[t], routed[pos[t·k + j]]>`` (:func:`_gather_dot`).

The sort (``order``) and the per-expert counts are the engine's router's. What this
replaces in TorchTitan's MoE layer: the gather by fancy indexing and its index_put backward, and the combine's zeros
+ index_put scatter + fp32 copies + batched [1, k] x [k, d] product. Memory-bound: rows moved once per direction.
Grid: (rows, column blocks of ``BLOCK``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus.turbo.triton.launch import num_warps

BLOCK = 1024


@triton.jit
def _gather_rows_kernel(src_ptr, idx_ptr, scale_ptr, out_ptr, n_cols, k, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = src[idx[i] // k] (· scale[idx[i]])."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    slot = tl.load(idx_ptr + row).to(tl.int64)
    v = tl.load(src_ptr + (slot // k) * n_cols + cols, mask=mask, other=0.0)
    if HAS_SCALE:
        v = v.to(tl.float32) * tl.load(scale_ptr + slot).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_sum_kernel(src_ptr, pos_ptr, w_ptr, out_ptr, n_cols, k, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = Σ_j (w[t·k + j] ·) src[pos[t·k + j]], in fp32."""
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(k):
        slot = tok * k + j
        row = tl.load(pos_ptr + slot).to(tl.int64)
        v = tl.load(src_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + slot).to(tl.float32)
        acc += v
    tl.store(out_ptr + tok * n_cols + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_dot_kernel(dout_ptr, src_ptr, pos_ptr, out_ptr, n_cols, k, BLOCK: tl.constexpr):
    """out[t·k + j] = <dout[t], src[pos[t·k + j]]>, in fp32 (one program per slot, the row in blocks)."""
    slot = tl.program_id(0).to(tl.int64)
    tok = slot // k
    row = tl.load(pos_ptr + slot).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(dout_ptr + tok * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(src_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        acc += g * v
    tl.store(out_ptr + slot, tl.sum(acc, axis=0))


def _block(n_cols: int) -> int:
    return min(BLOCK, triton.next_power_of_2(n_cols))


def _gather_rows(src: torch.Tensor, idx: torch.Tensor, k: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    out = src.new_empty(idx.numel(), src.shape[1])
    if out.numel():
        block = _block(src.shape[1])
        grid = (idx.numel(), triton.cdiv(src.shape[1], block))
        _gather_rows_kernel[grid](
            src, idx, scale if scale is not None else idx, out, src.shape[1], k,
            HAS_SCALE=scale is not None, BLOCK=block, num_warps=num_warps(block),
        )  # fmt: skip
    return out


def _gather_sum(
    src: torch.Tensor, pos: torch.Tensor, k: int, w: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    tokens = pos.numel() // k
    out = src.new_empty(tokens, src.shape[1], dtype=dtype or src.dtype)
    if out.numel():
        block = _block(src.shape[1])
        grid = (tokens, triton.cdiv(src.shape[1], block))
        _gather_sum_kernel[grid](
            src, pos, w if w is not None else pos, out, src.shape[1], k,
            HAS_W=w is not None, BLOCK=block, num_warps=num_warps(block),
        )  # fmt: skip
    return out


def _gather_dot(dout: torch.Tensor, src: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.empty(pos.numel(), dtype=torch.float32, device=src.device)
    if out.numel():
        block = _block(src.shape[1])
        _gather_dot_kernel[(pos.numel(),)](
            dout, src, pos, out, src.shape[1], k, BLOCK=block, num_warps=num_warps(block)
        )
    return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous plain tensor: expert parallelism's all-to-alls (torch's functional collectives) hand
    over AsyncCollectiveTensors, whose data is valid only once waited on."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(t, AsyncCollectiveTensor):
        t = t.trigger_wait()
    return t.contiguous()


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """pos with pos[order[i]] = i: where each slot's row sits in the permuted rows."""
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return pos


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
        order = _plain(order)
        ctx.save_for_backward(order)
        ctx.k, ctx.dtype = k, x.dtype
        return _gather_rows(_plain(x), order, k)

    @staticmethod
    def backward(ctx, d_routed: torch.Tensor):
        (order,) = ctx.saved_tensors
        return _gather_sum(_plain(d_routed), _inverse(order), ctx.k, dtype=ctx.dtype), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, routed: torch.Tensor, order: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        routed, probs = _plain(routed), _plain(probs)
        k, order = probs.shape[1], _plain(order)
        pos = _inverse(order)
        ctx.save_for_backward(routed, order, pos, probs)
        ctx.k = k
        return _gather_sum(routed, pos, k, probs.reshape(-1))

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        routed, order, pos, probs = ctx.saved_tensors
        d_out = _plain(d_out)
        d_routed = _gather_rows(d_out, order, ctx.k, probs.reshape(-1)) if ctx.needs_input_grad[0] else None
        d_probs = None
        if ctx.needs_input_grad[2]:
            d_probs = _gather_dot(d_out, routed, pos, ctx.k).view_as(probs).to(probs.dtype)
        return d_routed, None, d_probs


def moe_permute(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens ``x`` ``[T, d]`` into their experts' order: ``routed[i] = x[order[i] // k]`` (core's contract)."""
    return _Permute.apply(x, order, k)


def unpermute(routed: torch.Tensor, order: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The experts' outputs ``routed`` back to token order, each token's k rows weighted by ``probs`` ``[T, k]``."""
    return _Unpermute.apply(routed, order, probs)


moe_permute.unpermute = unpermute
