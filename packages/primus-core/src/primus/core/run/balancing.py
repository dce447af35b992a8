"""A mixture-of-experts router's auxiliary load-balancing losses: one definition for every engine.

For one MoE layer, a set of T tokens routed by it, E experts and top-k:

- scores ``s[t, i]``: the softmax of the router's logits in fp32, or (a sigmoid router) the sigmoid normalised to
  sum 1 over the experts (DeepSeek-V3's s');
- ``c[i]``: the tokens whose k highest scores include expert i (the raw scores: no routing bias, no group limit);
- ``f[i] = c[i] / (k T)``, ``P[i] = sum_t s[t, i] / T``; the loss is ``E * sum_i f[i] P[i]`` (1 when even).

``model.moe.balancing: aux_loss`` takes T = one routed micro-batch (what one data-parallel rank routes in one
forward: Switch Transformer's and GShard's batch, Hugging Face Qwen3-MoE's forward; megatron-core's ``aux_loss``);
``model.moe.seq_aux_loss_coeff`` takes T = each sequence, the losses averaged over the micro-batch's sequences
(DeepSeek-V3's sequence-wise balance loss, its eqs. 17-20; megatron-core's ``seq_aux_loss``). The training
objective adds ``coeff × sum over MoE layers of the mean over the global batch's routed micro-batches``;
``moe_aux_loss`` / ``moe_seq_aux_loss`` (:data:`primus.core.run.expert_load.METRICS`) report the losses before the
coefficient, mean over MoE layers and routed micro-batches.

A set of tokens may be spread over ranks (a sequence split by context parallelism): each rank passes the counts of
the whole set and its own scores with ``tokens`` = the whole set's; the ranks' losses then sum to the set's.
"""

from __future__ import annotations

from typing import Any

import torch


def balancing_scores(logits: torch.Tensor, k: int, score: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [..., E] fp32, routed [..., E] bool)`` from router logits ``[..., E]``: the scores the losses
    average and each token's k highest (the routing they count)."""
    if score == "sigmoid":
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        scores = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(scores, k=k, dim=-1).indices
    routed = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)
    return scores, routed


def switch_loss(scores: torch.Tensor, counts: torch.Tensor, k: int, tokens: int | None = None) -> torch.Tensor:
    """``E * sum_i f[i] P[i]`` of each token set, averaged over the sets: ``scores [..., T, E]`` (a leading dim per
    set, e.g. ``[B, S, E]`` for sequences), ``counts [..., E]`` each set's tokens per expert, ``tokens`` each set's
    size (default T: the scores are the whole set's)."""
    n, num_experts = scores.shape[-2], scores.shape[-1]
    tokens = n if tokens is None else tokens
    per_set = (scores.sum(dim=-2) * counts.to(scores.dtype)).sum(dim=-1) * (num_experts / (k * tokens * tokens))
    return per_set.mean()


def batch_loss(scores: torch.Tensor, routed: torch.Tensor, k: int) -> torch.Tensor:
    """``balancing: aux_loss`` over one routed micro-batch: ``scores`` / ``routed`` ``[T, E]``."""
    return switch_loss(scores, routed.sum(dim=0), k)


def sequence_loss(scores: torch.Tensor, routed: torch.Tensor, k: int, seq_len: int) -> torch.Tensor:
    """``seq_aux_loss_coeff``'s loss over one routed micro-batch: ``scores`` / ``routed`` ``[B * seq_len, E]``, each
    sequence's tokens contiguous (batch-major), the mean over its B sequences."""
    scores = scores.reshape(-1, seq_len, scores.shape[-1])
    return switch_loss(scores, routed.reshape(scores.shape).sum(dim=-2), k)


class AttachLoss(torch.autograd.Function):
    """``x`` unchanged, ``loss`` joining the backward pass: its gradient is ``scale`` (what the engine's gradient
    scale gives one routed micro-batch's share of the objective), whatever reaches ``x``. For a loss computed inside
    the model, which its caller's loss (the last pipeline stage's) never sees: megatron-core's
    MoEAuxLossAutoScaler is the same device."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def attach(x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """:class:`AttachLoss` applied: ``x``, through which ``loss × scale`` is backpropagated too."""
    return AttachLoss.apply(x, loss, scale)
