"""Triton quantization of the FP8 grouped GEMM's (:mod:`.grouped`) expert weights and wgrad operands: the PyTorch
path's arithmetic (:func:`primus.turbo.fp8.quantize.quantize_torch`: ``fp8_max / max(amax, eps)``, saturating
round-to-nearest-even, non-finite amax → NaN ``scale_inv``) in a few passes, with no host synchronisation.

- :func:`quantize_experts`: ``w`` [G, N, K] in both layouts torch's grouped kernel takes, from one amax pass (row amax
  in registers, column amax by atomic max across row blocks) and one cast pass writing the forward's row-scaled
  [G, N, K] and the dgrad's column-scaled transposed [G, K, N] copies from the same tile;
- :func:`jagged_padded_t`: an activation [T, C] scaled per (expert, column) over each expert's tokens, written
  straight into the wgrad's zero-padded buffer with 16-row aligned groups, transposed ([C, L], L contiguous, as the
  grouped kernel reads both wgrad operands), and the buffer's group ends, computed on the device. One program per
  (expert, column block) loops over its expert's rows twice (amax, then cast; the second read mostly from L2).

The buffer length is a static bound (T rounded up to 16, plus 16 per expert), so nothing waits on ``offs``. Rows of
the buffer past the last group are left unwritten (no group reads them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus.turbo.fp8.recipe import FP8_MAX
from primus.turbo.fp8.scaling import AMAX_EPS, DTYPES
from primus.turbo.fp8.triton_quantize import abs_nan_as_inf, fp8_grid, to_fp8

ALIGN = 16  # tokens: the wgrad's group starts (16 bytes of fp8)
JAG_ROWS, JAG_COLS = 128, 64  # tile of the jagged kernel: 128 B of bf16 per row read, 128 B of fp8 per column written
W_ROWS, W_COLS = 64, 128  # tile of the weight kernels
AMAX_PROGRAMS = 1024  # the amax pass splits a matrix's columns until it has about this many programs (~8 per SM)


def padded_length(tokens: int, groups: int) -> int:
    """Rows of the wgrad buffer: every group padded to a multiple of :data:`ALIGN` fits (each pads by < ALIGN)."""
    return triton.cdiv(tokens, ALIGN) * ALIGN + ALIGN * groups


@triton.jit
def _scale(amax, FMAX: tl.constexpr, EPS: tl.constexpr):
    return tl.where(amax < float("inf"), FMAX / tl.maximum(amax, EPS), 1.0)


@triton.jit
def _scale_inv(amax, FMAX: tl.constexpr, EPS: tl.constexpr):
    return tl.where(amax < float("inf"), tl.maximum(amax, EPS) / FMAX, float("nan"))


@triton.jit
def _weight_amax_kernel(
    w_ptr,
    row_amax_ptr,
    col_amax_ptr,
    N,
    K,
    K_PER: tl.constexpr,
    COLS_TOO: tl.constexpr,
    SPLIT: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Program (g, row block, column split): the rows' amax over the split's K_PER columns, the columns' over these
    rows (atomic max). One split (SPLIT false): the row amax is complete here and stored; several (a few large
    matrices, too few row blocks to fill the GPU): each split's row amax is an atomic max too."""
    g, rb, sp = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    rows = rb * ROWS + tl.arange(0, ROWS)
    rmask = rows < N
    base = w_ptr + g * N * K + rows[:, None].to(tl.int64) * K
    ramax = tl.zeros([ROWS], dtype=tl.float32)
    for c0 in range(sp * K_PER, tl.minimum(sp * K_PER + K_PER, K), COLS):
        cols = c0 + tl.arange(0, COLS)
        cmask = cols < K
        a = abs_nan_as_inf(
            tl.load(base + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        )
        ramax = tl.maximum(ramax, tl.max(a, axis=1))
        if COLS_TOO:
            tl.atomic_max(col_amax_ptr + g * K + cols, tl.max(a, axis=0), mask=cmask)
    if SPLIT:
        tl.atomic_max(row_amax_ptr + g * N + rows, ramax, mask=rmask)
    else:
        tl.store(row_amax_ptr + g * N + rows, ramax, mask=rmask)


@triton.jit
def _weight_cast_kernel(
    w_ptr,
    q_ptr,
    qt_ptr,
    row_amax_ptr,
    col_amax_ptr,
    row_sinv_ptr,
    col_sinv_ptr,
    N,
    K,
    PER_MATRIX: tl.constexpr,
    WRITE_Q: tl.constexpr,
    FMAX: tl.constexpr,
    EPS: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Program (g, row block, column block): the tile row-scaled into q [G, N, K] and column-scaled into the
    transposed qt [G, K, N] (the store is coalesced along N). PER_MATRIX (tensorwise): row_amax_ptr holds one amax
    per matrix, used for both. WRITE_Q false: the transposed copy (and both scale vectors) alone."""
    g, rb, cb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    rows = rb * ROWS + tl.arange(0, ROWS)
    cols = cb * COLS + tl.arange(0, COLS)
    rmask, cmask = rows < N, cols < K
    if PER_MATRIX:
        ra = tl.load(row_amax_ptr + g + rows * 0)
        ca = tl.load(row_amax_ptr + g + cols * 0)
    else:
        ra = tl.load(row_amax_ptr + g * N + rows, mask=rmask, other=0.0)
        ca = tl.load(col_amax_ptr + g * K + cols, mask=cmask, other=0.0)
    mask = rmask[:, None] & cmask[None, :]
    off = g * N * K + rows[:, None].to(tl.int64) * K + cols[None, :]
    x = tl.load(w_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if WRITE_Q:
        q = tl.clamp(x * _scale(ra, FMAX, EPS)[:, None], -FMAX, FMAX)
        tl.store(q_ptr + off, to_fp8(q, q_ptr.dtype.element_ty, MANT, EMIN), mask=mask)
    qt = tl.clamp(x * _scale(ca, FMAX, EPS)[None, :], -FMAX, FMAX)
    off_t = g * N * K + cols[None, :].to(tl.int64) * N + rows[:, None]
    tl.store(qt_ptr + off_t, to_fp8(qt, qt_ptr.dtype.element_ty, MANT, EMIN), mask=mask)
    if cb == 0:
        tl.store(row_sinv_ptr + g * N + rows, _scale_inv(ra, FMAX, EPS), mask=rmask)
    if rb == 0:
        tl.store(col_sinv_ptr + g * K + cols, _scale_inv(ca, FMAX, EPS), mask=cmask)


def quantize_experts(w: torch.Tensor, fmt: str, rowwise: bool, *, write_q: bool = True):
    """``w`` [G, N, K] → (q [G, N, K] scaled along K, scale_inv [G, N]; qt [G, K, N] = the transposed matrices scaled
    along N, scale_inv [G, K]): the forward's and the dgrad's operands. Tensorwise: one scale per matrix, repeated.
    ``write_q`` false: q is None (the transposed copy alone; its row pass still gives the first scales)."""
    w = w.contiguous()
    g, n, k = w.shape
    dtype, fmax = DTYPES[fmt], FP8_MAX[fmt]
    q = torch.empty(g, n, k, dtype=dtype, device=w.device) if write_q else None
    qt = torch.empty(g, k, n, dtype=dtype, device=w.device)
    row_sinv = torch.empty(g, n, dtype=torch.float32, device=w.device)
    col_sinv = torch.empty(g, k, dtype=torch.float32, device=w.device)
    if not w.numel():
        row_sinv.fill_(AMAX_EPS / fmax)
        col_sinv.fill_(AMAX_EPS / fmax)
        return q, row_sinv, qt, col_sinv
    row_blocks, col_blocks = triton.cdiv(n, W_ROWS), triton.cdiv(k, W_COLS)
    # a stack of experts has thousands of row blocks; one large matrix (a dense linear's weight or activation) may
    # have ~100, under one program per SM: its columns are split so that the amax pass fills the GPU
    splits = max(1, min(col_blocks, AMAX_PROGRAMS // (g * row_blocks)))
    k_per = triton.cdiv(col_blocks, splits) * W_COLS
    splits = triton.cdiv(k, k_per)
    row_amax = (torch.zeros if splits > 1 else torch.empty)(g, n, dtype=torch.float32, device=w.device)
    col_amax = torch.zeros(g, k, dtype=torch.float32, device=w.device) if rowwise else row_amax
    _weight_amax_kernel[(g, row_blocks, splits)](
        w,
        row_amax,
        col_amax,
        n,
        k,
        K_PER=k_per,
        COLS_TOO=rowwise,
        SPLIT=splits > 1,
        ROWS=W_ROWS,
        COLS=W_COLS,
        num_warps=4,
    )
    if not rowwise:  # one amax per matrix (NaN → inf already)
        row_amax = row_amax.amax(dim=1)
    _weight_cast_kernel[(g, row_blocks, col_blocks)](
        w,
        q if write_q else qt,
        qt,
        row_amax,
        col_amax,
        row_sinv,
        col_sinv,
        n,
        k,
        PER_MATRIX=not rowwise,
        WRITE_Q=write_q,
        FMAX=fmax,
        EPS=AMAX_EPS,
        ROWS=W_ROWS,
        COLS=W_COLS,
        num_warps=8,
        **fp8_grid(fmt),
    )
    return q, row_sinv, qt, col_sinv


@triton.jit
def _jagged_kernel(
    t_ptr,
    q_ptr,
    sinv_ptr,
    offs_ptr,
    ends_ptr,
    amax_ptr,
    n_cols,
    length,
    G,
    GIVEN_AMAX: tl.constexpr,
    WRITE_ENDS: tl.constexpr,
    FMAX: tl.constexpr,
    EPS: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    ALIGN_ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Program (g, column block): group g's rows [start, end) of t [T, C], scaled per column by their amax over the
    group (or the given tensorwise amax), into columns [pstart, pstart + padded size) of q [C, length], zeros after
    the group's last row. The padded start is the sum of the earlier groups' sizes rounded up to ALIGN_ROWS."""
    g, cb = tl.program_id(0), tl.program_id(1)
    idx = tl.arange(0, BLOCK_G)
    ends = tl.load(offs_ptr + idx, mask=idx < G, other=0)
    prev = tl.load(offs_ptr + idx - 1, mask=(idx >= 1) & (idx < G), other=0)
    units = (ends - prev + ALIGN_ROWS - 1) // ALIGN_ROWS  # padded sizes in ALIGN_ROWS, so that the compiler
    start = tl.sum(tl.where(idx == g, prev, 0), axis=0)  # sees pstart and psize divisible (16-byte stores)
    end = tl.sum(tl.where(idx == g, ends, 0), axis=0)
    pstart = tl.sum(tl.where(idx < g, units, 0), axis=0) * ALIGN_ROWS
    psize = tl.sum(tl.where(idx == g, units, 0), axis=0) * ALIGN_ROWS
    cols = cb * COLS + tl.arange(0, COLS)
    cmask = cols < n_cols
    if GIVEN_AMAX:
        amax = tl.load(amax_ptr + cols * 0)
    else:
        amax = tl.zeros([COLS], dtype=tl.float32)
        for r0 in range(start, end, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            ptr = t_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :]
            x = tl.load(ptr, mask=(rows < end)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(abs_nan_as_inf(x), axis=0))
    scale = _scale(amax, FMAX, EPS)
    tl.store(sinv_ptr + g.to(tl.int64) * n_cols + cols, _scale_inv(amax, FMAX, EPS), mask=cmask)
    for r0 in range(0, psize, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        src = start + rows
        ptr = t_ptr + src[:, None].to(tl.int64) * n_cols + cols[None, :]
        x = tl.load(ptr, mask=(src < end)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        q = to_fp8(tl.clamp(x * scale[None, :], -FMAX, FMAX), q_ptr.dtype.element_ty, MANT, EMIN)
        dst = q_ptr + cols[None, :].to(tl.int64) * length + (pstart + rows)[:, None]
        tl.store(dst, q, mask=(rows < psize)[:, None] & cmask[None, :])
    if WRITE_ENDS:
        if cb == 0:
            tl.store(ends_ptr + g, pstart + psize)


def jagged_padded_t(
    t: torch.Tensor, offs: torch.Tensor, fmt: str, *, amax: torch.Tensor | None = None, ends: bool = False
):
    """``t`` [T, C] (rows sorted by group, ``offs`` [G] int32 cumulative ends) → (q [C, L] fp8: group g's rows,
    scaled per (g, column), at columns padded_ends[g-1] .. padded_ends[g] (zero-filled to a multiple of ALIGN);
    scale_inv [G·C]; padded_ends [G] int32 if ``ends`` else None). ``amax`` (tensorwise): one amax for all."""
    t = t.contiguous()
    tokens, cols = t.shape
    groups = offs.shape[0]
    length = padded_length(tokens, groups)
    q = torch.empty(cols, length, dtype=DTYPES[fmt], device=t.device)
    sinv = torch.empty(groups, cols, dtype=torch.float32, device=t.device)
    padded_ends = torch.empty(groups, dtype=torch.int32, device=t.device) if ends else None
    if groups and cols:
        _jagged_kernel[(groups, triton.cdiv(cols, JAG_COLS))](
            t,
            q,
            sinv,
            offs,
            padded_ends if ends else sinv,
            amax.float().reshape(()) if amax is not None else sinv,
            cols,
            length,
            groups,
            GIVEN_AMAX=amax is not None,
            WRITE_ENDS=ends,
            FMAX=FP8_MAX[fmt],
            EPS=AMAX_EPS,
            ALIGN_ROWS=ALIGN,
            BLOCK_G=triton.next_power_of_2(groups),
            ROWS=JAG_ROWS,
            COLS=JAG_COLS,
            num_warps=4,
            **fp8_grid(fmt),
        )
    elif ends:
        padded_ends.zero_()
    return q, sinv.reshape(-1), padded_ends
