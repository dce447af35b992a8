"""Mixture-of-experts router after its gate, in one Triton program per token: scores, top-k, weights, and backward.

Core's contract (:mod:`primus.core.kernels.selection`, ``moe_router``): scores = softmax or sigmoid of the gate's logits (fp32);
each token's k experts are the top k of ``scores + bias`` (loss-free balancing's expert bias chooses, it does not
weigh); their weights are the chosen scores, divided by their sum when ``normalize``, times ``scale``.

Forward: the token's E logits in registers, the scores, then k rounds of argmax (ties to the lower expert) masking each
pick; weights and indices written once (TorchTitan runs softmax, an add, topk, gather, sum and two divides as separate
kernels, each a pass over [T, E] or [T, k]). Backward recomputes the scores from the logits (nothing of size [T, E] is
kept) and goes back through the normalisation, the gather (a dense [E] gradient with the k picks filled) and the
softmax (``s · (g − Σ g·s)``) or sigmoid (``g · s · (1 − s)``). E up to 4,096 (a row in registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus.turbo.triton.launch import num_warps

MAX_EXPERTS = 4096


@triton.jit
def _scores(logits_ptr, row, n, cols, mask, SOFTMAX: tl.constexpr):
    x = tl.load(logits_ptr + row * n + cols, mask=mask, other=-float("inf")).to(tl.float32)
    if SOFTMAX:
        e = tl.exp(x - tl.max(x, axis=0))
        e = tl.where(mask, e, 0.0)
        s = e / tl.sum(e, axis=0)
    else:
        s = tl.where(mask, tl.sigmoid(x), 0.0)
    return s


@triton.jit
def _router_fwd(
    logits_ptr, bias_ptr, probs_ptr, idx_ptr, n, scale,
    K: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    s = _scores(logits_ptr, row, n, cols, mask, SOFTMAX)
    choose = s
    if HAS_BIAS:
        choose = s + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    choose = tl.where(mask, choose, -float("inf"))
    ks = tl.arange(0, BLOCK_K)
    vals = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(K):
        pick = tl.argmax(choose, axis=0)
        v = tl.sum(tl.where(cols == pick, s, 0.0), axis=0)
        vals = tl.where(ks == j, v, vals)
        ids = tl.where(ks == j, pick.to(tl.int64), ids)
        choose = tl.where(cols == pick, -float("inf"), choose)
    if NORM:
        vals = vals / (tl.sum(vals, axis=0) + 1e-20)
    kmask = ks < K
    tl.store(probs_ptr + row * K + ks, vals * scale, mask=kmask)
    tl.store(idx_ptr + row * K + ks, ids, mask=kmask)


@triton.jit
def _router_bwd(
    dprobs_ptr, logits_ptr, idx_ptr, dlogits_ptr, n, scale,
    K: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    s = _scores(logits_ptr, row, n, cols, mask, SOFTMAX)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    ids = tl.load(idx_ptr + row * K + ks, mask=kmask, other=-1)
    dp = tl.load(dprobs_ptr + row * K + ks, mask=kmask, other=0.0).to(tl.float32) * scale
    picked = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(K):  # the chosen scores, again
        idj = tl.sum(tl.where(ks == j, ids, 0), axis=0)
        picked = tl.where(ks == j, tl.sum(tl.where(cols == idj, s, 0.0), axis=0), picked)
    if NORM:  # p_j = v_j / S: dv_j = (dp_j - Σ_i dp_i p_i) / S
        total = tl.sum(picked, axis=0) + 1e-20
        dv = (dp - tl.sum(dp * picked, axis=0) / total) / total
    else:
        dv = dp
    g = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        idj = tl.sum(tl.where(ks == j, ids, 0), axis=0)
        g = tl.where(cols == idj, g + tl.sum(tl.where(ks == j, dv, 0.0), axis=0), g)
    if SOFTMAX:
        d = s * (g - tl.sum(g * s, axis=0))
    else:
        d = g * s * (1.0 - s)
    tl.store(dlogits_ptr + row * n + cols, d.to(dlogits_ptr.dtype.element_ty), mask=mask)


def _launch_args(logits: torch.Tensor, k: int) -> dict:
    experts = logits.shape[1]
    if experts > MAX_EXPERTS:
        raise ValueError(f"moe_router: {experts} experts; the Triton router holds at most {MAX_EXPERTS} in a program")
    if not 0 < k <= experts:
        raise ValueError(f"moe_router: top-k {k} must be within 1..{experts} experts")
    block = triton.next_power_of_2(experts)
    return {"K": k, "BLOCK_K": triton.next_power_of_2(k), "BLOCK": block, "num_warps": min(num_warps(block), 8)}


class _Router(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, softmax, bias, normalize, scale):
        logits = logits.contiguous()
        tokens, experts = logits.shape
        probs = torch.empty(tokens, k, dtype=torch.float32, device=logits.device)
        indices = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
        if tokens:
            _router_fwd[(tokens,)](
                logits, bias if bias is not None else logits, probs, indices, experts, float(scale),
                SOFTMAX=softmax, HAS_BIAS=bias is not None, NORM=normalize, **_launch_args(logits, k),
            )  # fmt: skip
        ctx.save_for_backward(logits, indices)
        ctx.options = (k, softmax, normalize, float(scale))
        ctx.mark_non_differentiable(indices)
        return probs, indices

    @staticmethod
    def backward(ctx, dprobs, _dindices):
        logits, indices = ctx.saved_tensors
        k, softmax, normalize, scale = ctx.options
        dlogits = torch.empty_like(logits)
        if logits.shape[0]:
            _router_bwd[(logits.shape[0],)](
                dprobs.contiguous(), logits, indices, dlogits, logits.shape[1], scale,
                SOFTMAX=softmax, NORM=normalize, **_launch_args(logits, k),
            )  # fmt: skip
        return dlogits, None, None, None, None, None


def moe_router(
    logits, k, *, score="softmax", bias=None, normalize=False, scale=1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` fp32, expert indices ``[T, k]`` int64) of each token from its gate logits ``[T, E]`` (core's
    contract: ``score`` softmax / sigmoid, ``bias`` ``[E]`` or None, ``normalize`` bool, ``scale`` float)."""
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"moe_router: score {score!r}; allowed: softmax, sigmoid")
    if bias is not None:
        bias = bias.detach().contiguous()
    return _Router.apply(logits, k, score == "softmax", bias, normalize, scale)
