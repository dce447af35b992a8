"""Context-parallel attention in plain PyTorch: the sequence split over the ranks of a process group.

Layout (megatron's load-balanced one; torch's experimental context_parallel calls it head-tail): the global
sequence is cut into ``2·cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2·cp-1-r`` concatenated, so under a causal mask every rank
has the same work (:func:`shard_for_cp` / :func:`unshard_from_cp`). Rank ``r``'s local positions stay in global
order, which the masks below rely on.

:func:`ring_attention` takes q ``[b, s_local, h_q, d]``, k/v ``[b, s_local, h_kv, d]`` (``h_q % h_kv == 0``; GQA
never repeats K/V: the ``g = h_q / h_kv`` query heads of a K/V head are folded into the rows of one matmul).
Two variants, both ``torch.autograd.Function``\\ s that keep only the local q/k/v, the output and the fp32
log-sum-exp (LSE) for backward, which recomputes the scores:

``variant="ring"`` (default)
    cp steps; at step ``i`` rank ``r`` holds the K/V of rank ``src = r - i`` (mod cp) and sends it on to ``r + 1``
    while it computes (``batch_isend_irecv``). Per (query half, key half) the causal mask is one of three
    blocks: ``src == r`` the local causal block (the local order is global order); ``src < r`` all queries
    against the first key half only (the second is later than every local query); ``src > r`` the second
    query half only against all keys. Each off-diagonal step is half a block, for every rank. Partial outputs
    are merged with their LSE (``lse = logaddexp(lse, l)``, outputs reweighted by ``exp(l_i - lse)``, fp32).
    Backward circulates K/V again; a dK/dV accumulator (fp32) travels with each K/V block and after cp hops
    arrives back at its owner complete.
``variant="allgather"``
    all-gathers K/V once (``h_kv`` heads only); each local query chunk ``c`` then attends to the global keys
    ``[0, (c+1)·L)`` (``L`` = chunk length): the earlier chunks as one full block, its own chunk causally, the two
    merged by LSE. Backward gathers K/V again and reduce-scatters the fp32 dK/dV. Two collectives a pass instead
    of the ring's ``cp-1`` K/V hops (and ``cp`` dK/dV hops in backward): simpler, and for small cp often faster,
    at the price of the gathered ``2·S·h_kv·d`` elements, held only during the call.

Blocks are full or square-causal, computed by a block kernel that returns its LSE: torch's flash-attention ops
(``aten._scaled_dot_product_flash_attention`` and its backward) for fp16 / bf16 on a GPU, otherwise explicit
fp32 matmuls (scores ``[b, h_kv, g·s_q, s_k]`` materialised per block), correct on any device and the reference.

Provider: ``attention`` below is the ``ring`` attention provider's impl (core's contract, ``[b, h, s, d]``,
whole sequence); ``attention.context_parallel(q, k, v, *, group, causal, scale, variant)`` is the same
contract for a sequence shard, which a backend calls when ``parallel.cp > 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

VARIANTS = ("ring", "allgather")

# torch 2.13 deprecates the *_tensor names (same signature); older releases may have only those
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_KV_TAG, _DKV_TAG = 0, 1  # distinct streams between a pair of ranks (gloo matches messages by tag)


# --- the load-balanced layout -----------------------------------------------------------------------------


def check_cp_seq_len(seq_len: int, cp: int) -> None:
    """Raise ``ValueError`` naming the sizes unless ``seq_len`` splits into ``2·cp`` equal chunks."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1 (got {cp})")
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2·cp = {2 * cp} (cp={cp}): the load-balanced "
            f"context-parallel layout cuts the sequence into {2 * cp} equal chunks"
        )


def cp_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunk indices rank ``rank`` holds, in its local order: ``(rank, 2·cp-1-rank)``."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside the context-parallel group of size {cp}")
    return rank, 2 * cp - 1 - rank


def shard_for_cp(x: torch.Tensor, cp: int, rank: int, seq_dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` (the whole sequence along ``seq_dim``): chunks ``rank`` and ``2·cp-1-rank`` of
    ``2·cp``, concatenated (a new tensor). Raises ``ValueError`` when the length does not split evenly."""
    check_cp_seq_len(x.shape[seq_dim], cp)
    chunks = x.chunk(2 * cp, dim=seq_dim)
    first, second = cp_chunks(cp, rank)
    return torch.cat((chunks[first], chunks[second]), dim=seq_dim)


def unshard_from_cp(chunks: Sequence[torch.Tensor], cp: int, seq_dim: int = 1) -> torch.Tensor:
    """The whole sequence from the ``cp`` ranks' parts (``chunks[r]``: rank r's ``shard_for_cp``); the inverse of
    :func:`shard_for_cp`."""
    if len(chunks) != cp:
        raise ValueError(f"unshard_from_cp: {len(chunks)} parts for cp={cp}; pass one per rank, in rank order")
    halves: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(chunks):
        if part.shape[seq_dim] % 2:
            raise ValueError(
                f"unshard_from_cp: rank {rank}'s part has {part.shape[seq_dim]} positions along dim {seq_dim}, "
                "not two equal chunks"
            )
        first, second = cp_chunks(cp, rank)
        halves[first], halves[second] = part.chunk(2, dim=seq_dim)
    return torch.cat(halves, dim=seq_dim)


# --- block kernels: q [b, hk, g, sq, d], k/v [b, hk, sk, d]; lse, delta [b, hk, g, sq] --------------------------
#
# A block is full (every query sees every key) or square-causal (sq == sk, one chunk against itself): both variants
# cut their work into such blocks, so any attention kernel that returns its LSE, and takes it back in backward,
# can compute them. ``forward(q, k, v, scale, causal) -> (out, lse fp32)``; ``backward(q, k, v, dout, out, lse,
# delta, scale, causal) -> (dq, dk, dv)`` with ``out``/``lse`` the final (merged) ones, ``delta = rowsum(dout · out)``.


def _acc(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inputs in the accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return tuple(x.to(torch.promote_types(x.dtype, torch.float32)) for x in xs)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    b, hk, g, sq, d = q.shape
    # the g query heads sharing a K/V head are rows of one matmul: K is never repeated
    s = torch.matmul(q.reshape(b, hk, g * sq, d), k.transpose(-1, -2)).view(b, hk, g, sq, -1).mul_(scale)
    if causal:  # key j later than query i masked (square block)
        s.masked_fill_(torch.ones(sq, sq, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s


class _MathBlocks:
    """Explicit matmuls in fp32 (fp64 for fp64 inputs), the ``[b, hk, g·sq, sk]`` scores materialised: any device
    and dtype; the reference the fused kernels are checked against."""

    name = "math"

    @staticmethod
    def forward(q, k, v, scale, causal):
        q, k, v = _acc(q, k, v)
        b, hk, g, sq, d = q.shape
        s = _scores(q, k, scale, causal)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s.sub_(lse.unsqueeze(-1)))
        return torch.matmul(p.view(b, hk, g * sq, -1), v).view(b, hk, g, sq, d), lse

    @staticmethod
    def backward(q, k, v, dout, out, lse, delta, scale, causal):
        q, k, v, dout = _acc(q, k, v, dout)
        b, hk, g, sq, d = q.shape
        p = torch.exp(_scores(q, k, scale, causal).sub_(lse.unsqueeze(-1)))  # probabilities, 0 where masked
        rows = (b, hk, g * sq)
        dout_rows = dout.reshape(*rows, d)
        dv = torch.matmul(p.view(*rows, -1).transpose(-1, -2), dout_rows)
        dp = torch.matmul(dout_rows, v.transpose(-1, -2)).view_as(p)
        ds = p.mul_(dp.sub_(delta.unsqueeze(-1))).view(*rows, -1)  # dS = P ∘ (dP - delta), in p's memory
        dq = torch.matmul(ds, k).mul_(scale).view(b, hk, g, sq, d)
        dk = torch.matmul(ds.transpose(-1, -2), q.reshape(*rows, d)).mul_(scale)
        return dq, dk, dv


class _FlashBlocks:
    """torch's flash-attention kernels (``aten._scaled_dot_product_flash_attention`` and its backward, the ops SDPA's
    flash backend and torch's own experimental context parallelism call): CUDA / ROCm, fp16 / bf16, GQA native.
    Heads are taken as ``[b, hk·g, s, d]`` views (query head ``i·g + j`` uses K/V head ``i``, as in GQA)."""

    name = "flash"

    @staticmethod
    def forward(q, k, v, scale, causal):
        b, hk, g, sq, d = q.shape
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q.reshape(b, hk * g, sq, d), k, v, 0.0, causal, False, scale=scale
        )
        return res[0].view(b, hk, g, sq, d), res[1].view(b, hk, g, sq)

    @staticmethod
    def backward(q, k, v, dout, out, lse, delta, scale, causal):
        b, hk, g, sq, d = q.shape
        heads = (b, hk * g, sq, d)
        seed = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: the RNG state is not read
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.reshape(heads),
            q.reshape(heads),
            k,
            v,
            out.reshape(heads),
            lse.reshape(b, hk * g, sq).contiguous(),
            None,
            None,
            sq,
            k.shape[-2],
            0.0,
            causal,
            seed,
            seed,
            scale=scale,
        )
        return dq.view(b, hk, g, sq, d), dk, dv


def _block_kernels(q: torch.Tensor, head_dim: int) -> type[_MathBlocks] | type[_FlashBlocks]:
    """Flash on a GPU for fp16 / bf16 and head sizes it takes; the fp32 matmuls elsewhere."""
    fused = (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention")
    )
    return _FlashBlocks if fused else _MathBlocks


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_o: torch.Tensor) -> None:
    """Fold a block's ``(o, lse_o)`` into the running ``(out, lse)`` in place. Stable: both weights are
    ``exp(x - logaddexp(...)) <= 1``; a running ``lse`` of -inf (no block yet) gets weight 0."""
    new = torch.logaddexp(lse, lse_o)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o * torch.exp(lse_o - new).unsqueeze(-1))
    lse.copy_(new)


# --- which blocks a ring step computes ---------------------------------------------------------------------


def _ring_blocks(rank: int, src: int, causal: bool, half: int) -> list[tuple[slice, slice, bool]]:
    """``(query rows, key columns, causal mask?)`` for rank ``rank`` holding the K/V of rank ``src`` (local
    positions; each rank's two chunks are ``[0, half)`` and ``[half, 2·half)``)."""
    every = slice(None)
    if not causal:
        return [(every, every, False)]
    if src == rank:
        return [(every, every, True)]  # chunks r < 2cp-1-r: the local order is the global order
    if src < rank:
        # keys: chunk src (earlier than both query chunks) and 2cp-1-src (later than both)
        return [(every, slice(0, half), False)]
    # src > rank: keys src and 2cp-1-src both lie between the query chunks r and 2cp-1-r
    return [(slice(half, None), every, False)]


def _gathered_blocks(rank: int, cp: int, causal: bool, half: int) -> list[tuple[slice, slice, bool]]:
    """``(query rows, global key columns, causal mask?)`` for the all-gather variant: query chunk c sees the
    earlier chunks ``[0, c·half)`` whole and its own chunk ``[c·half, (c+1)·half)`` causally."""
    if not causal:
        return [(slice(None), slice(None), False)]
    blocks = []
    for i, c in enumerate(cp_chunks(cp, rank)):
        rows = slice(i * half, (i + 1) * half)
        if c:
            blocks.append((rows, slice(0, c * half), False))
        blocks.append((rows, slice(c * half, (c + 1) * half), True))
    return blocks


# --- communication ------------------------------------------------------------------------------------------


def _ring_exchange(
    send: torch.Tensor, group: dist.ProcessGroup | None, rank: int, cp: int, tag: int
) -> tuple[torch.Tensor, list]:
    """Post: send ``send`` to the next rank, receive the previous rank's into a new buffer (async)."""
    recv = torch.empty_like(send)
    nxt = dist.get_global_rank(group, (rank + 1) % cp) if group is not None else (rank + 1) % cp
    prv = dist.get_global_rank(group, (rank - 1) % cp) if group is not None else (rank - 1) % cp
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prv, group, tag)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _gather_kv(kv: torch.Tensor, group: dist.ProcessGroup | None, cp: int) -> torch.Tensor:
    """``[2, b, s_local, hk, d]`` from every rank -> the global ``[2, b, hk, S, d]`` in sequence order."""
    # concatenated along dim 0 (the layout every backend takes; gloo refuses the stacked one)
    parts = kv.new_empty((cp * kv.shape[0], *kv.shape[1:]))
    _all_gather(parts, kv.contiguous(), group=group)
    parts = parts.view(cp, *kv.shape)
    halves: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank in range(cp):
        first, second = cp_chunks(cp, rank)
        halves[first], halves[second] = parts[rank].chunk(2, dim=2)
    return torch.cat(halves, dim=2).permute(0, 1, 3, 2, 4)


def _scatter_dkv(dkv: torch.Tensor, group: dist.ProcessGroup | None, cp: int) -> torch.Tensor:
    """Global fp32 ``[2, b, hk, S, d]`` gradients summed over the ranks -> this rank's ``[2, b, hk, s_local, d]``."""
    chunks = dkv.chunk(2 * cp, dim=3)
    per_rank = torch.stack([torch.cat([chunks[c] for c in cp_chunks(cp, rank)], dim=3) for rank in range(cp)])
    out = dkv.new_empty(per_rank.shape[1:])
    _reduce_scatter(out, per_rank.flatten(0, 1), group=group)
    return out


# --- autograd -----------------------------------------------------------------------------------------------


def _grouped(x: torch.Tensor, hk: int) -> torch.Tensor:
    """q-like ``[b, s, h, d]`` -> ``[b, hk, g, s, d]`` (a view where the strides allow)."""
    b, s, h, d = x.shape
    return x.reshape(b, s, hk, h // hk, d).permute(0, 2, 3, 1, 4)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """``[b, hk, g, s, d]`` -> ``[b, s, h, d]``."""
    b, hk, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hk * g, d)


def _forward_blocks(kernel, blocks, qg, kk, vv, out, lse, scale) -> None:
    for rows, cols, masked in blocks:
        o, lse_o = kernel.forward(qg[..., rows, :], kk[..., cols, :], vv[..., cols, :], scale, masked)
        _merge(out[..., rows, :], lse[..., rows], o, lse_o)


def _backward_blocks(kernel, blocks, qg, kk, vv, dout, result, lse, delta, dq, dkv, scale) -> None:
    for rows, cols, masked in blocks:
        grads = kernel.backward(
            qg[..., rows, :],
            kk[..., cols, :],
            vv[..., cols, :],
            dout[..., rows, :],
            result[..., rows, :],
            lse[..., rows],
            delta[..., rows],
            scale,
            masked,
        )
        dq[..., rows, :] += grads[0]
        dkv[0][..., cols, :] += grads[1]
        dkv[1][..., cols, :] += grads[2]


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, cp, rank, causal, scale, variant):
        hk, half = k.shape[2], q.shape[1] // 2
        kernel = _block_kernels(q, q.shape[-1])
        qg = _grouped(q, hk)
        kv = torch.stack((k, v))  # [2, b, s, hk, d]: one buffer per hop
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros(qg.shape, dtype=acc)
        lse = q.new_full(qg.shape[:-1], float("-inf"), dtype=torch.float32 if acc != torch.float64 else acc)
        if variant == "allgather":
            kk, vv = _gather_kv(kv, group, cp) if cp > 1 else kv.permute(0, 1, 3, 2, 4)
            _forward_blocks(kernel, _gathered_blocks(rank, cp, causal, half), qg, kk, vv, out, lse, scale)
        else:
            for step in range(cp):
                works = []
                if step + 1 < cp:  # the next K/V block travels while this one is computed
                    nxt, works = _ring_exchange(kv, group, rank, cp, _KV_TAG)
                kk, vv = kv.permute(0, 1, 3, 2, 4)  # [b, hk, s, d] each
                blocks = _ring_blocks(rank, (rank - step) % cp, causal, half)
                _forward_blocks(kernel, blocks, qg, kk, vv, out, lse, scale)
                if works:
                    _wait(works)
                    kv = nxt
        result = _ungrouped(out).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.args = (group, cp, rank, causal, scale, variant, kernel)
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, result, lse = ctx.saved_tensors
        group, cp, rank, causal, scale, variant, kernel = ctx.args
        (b, s, hk, d), half = k.shape, q.shape[1] // 2
        acc = torch.promote_types(q.dtype, torch.float32)
        qg, dout, result_g = _grouped(q, hk), _grouped(grad.to(q.dtype), hk), _grouped(result, hk)
        delta = (dout.to(acc) * result_g.to(acc)).sum(-1)  # rowsum(dO ∘ O): [b, hk, g, s]
        dq = torch.zeros(qg.shape, dtype=acc, device=q.device)
        kv = torch.stack((k, v))
        rest = (dout, result_g, lse, delta, dq)  # what every block's backward reads or adds to
        if variant == "allgather":
            kk, vv = _gather_kv(kv, group, cp) if cp > 1 else kv.permute(0, 1, 3, 2, 4)
            dkv = torch.zeros((2, *kk.shape), dtype=acc, device=q.device)
            _backward_blocks(kernel, _gathered_blocks(rank, cp, causal, half), qg, kk, vv, *rest, dkv, scale)
            mine = _scatter_dkv(dkv, group, cp) if cp > 1 else dkv
        else:
            dkv_works: list = []
            arrived = None  # the dK/dV accumulator received from the previous rank
            for step in range(cp):
                kv_works = []
                if step + 1 < cp:
                    nxt, kv_works = _ring_exchange(kv, group, rank, cp, _KV_TAG)
                kk, vv = kv.permute(0, 1, 3, 2, 4)
                part = torch.zeros((2, b, hk, s, d), dtype=acc, device=q.device)  # dK, dV of the K/V held now
                blocks = _ring_blocks(rank, (rank - step) % cp, causal, half)
                _backward_blocks(kernel, blocks, qg, kk, vv, *rest, part, scale)
                if dkv_works:  # the accumulator that travelled with this K/V block so far
                    _wait(dkv_works)
                    part += arrived
                # pass it on with the block; after the last step what arrives is this rank's own, complete.
                # `sending` keeps the buffer alive until its send is waited on.
                sending = part
                arrived, dkv_works = _ring_exchange(sending, group, rank, cp, _DKV_TAG) if cp > 1 else (part, [])
                if kv_works:
                    _wait(kv_works)
                    kv = nxt
            _wait(dkv_works)
            mine = arrived
        dk, dv = (x.permute(0, 2, 1, 3).to(k.dtype) for x in mine)  # [b, hk, s, d] -> [b, s, hk, d]
        return _ungrouped(dq).to(q.dtype), dk, dv, None, None, None, None, None, None


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"ring_attention: expected q [b, s, h_q, d] and k, v [b, s, h_kv, d] "
            f"(got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})"
        )
    (b, s, h, d), (bk, sk, hk, dk) = q.shape, k.shape
    if (b, s, d) != (bk, sk, dk):
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in batch, sequence or head size"
        )
    if h % hk:
        raise ValueError(f"ring_attention: {h} query heads are not a multiple of {hk} key/value heads")


def _check_layout(s: int, cp: int, variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"ring_attention: variant must be one of {', '.join(VARIANTS)} (got {variant!r})")
    if s % 2:
        raise ValueError(
            f"ring_attention: {s} local positions are not two equal chunks: the global sequence "
            f"({s} × cp {cp} = {s * cp}) is not divisible by 2·cp = {2 * cp}"
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    causal: bool = True,
    scale: float | None = None,
    variant: str = "ring",
) -> torch.Tensor:
    """Attention over a sequence split across the ranks of ``group`` (torch's convention: ``None`` is the
    default group), each rank holding its load-balanced shard (:func:`shard_for_cp`).

    :param q: ``[b, s_local, h_q, d]``.
    :param k: ``[b, s_local, h_kv, d]``, ``h_q`` a multiple of ``h_kv`` (GQA; K/V are never repeated).
    :param v: like ``k``.
    :param causal: causal over the global sequence; ``False``: every query sees every key.
    :param scale: softmax scale, ``d ** -0.5`` by default.
    :param variant: ``"ring"`` (P2P, K/V pass around the ring) or ``"allgather"`` (gather K/V, reduce-scatter
        dK/dV); see the module docstring.
    :returns: ``[b, s_local, h_q, d]`` in q's dtype: this rank's rows of the global attention output.
    :raises ValueError: on shapes that do not fit (a local length that is not two equal chunks names the
        global length and ``2·cp``).

    Every rank of ``group`` must call it with the same shapes and arguments (it communicates in forward and in
    backward).
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_shapes(q, k, v)
    _check_layout(q.shape[1], cp, variant)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _ContextParallelAttention.apply(q, k, v, group, cp, rank, causal, scale, variant)


# --- the ``ring`` provider: core's attention contract, [b, h, s, d] ------------------------------------------


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """Core's attention contract over the whole sequence on this rank (cp = 1): q ``[b, h, s, d]``, k/v
    ``[b, h_kv, s, d]``. The same block math as the context-parallel path, one block."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # -> [b, s, h, d] (views)
    _check_shapes(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _ContextParallelAttention.apply(q, k, v, None, 1, 0, causal, scale, "ring").transpose(1, 2)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
    """:func:`ring_attention` (the same keyword ``options``: group, causal, scale, variant) in core's layout:
    q ``[b, h, s_local, d]``, k/v ``[b, h_kv, s_local, d]``."""
    return ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **options).transpose(1, 2)


# what the provider's "context_parallel" feature promises: this attribute on its impl
attention.context_parallel = context_parallel_attention
