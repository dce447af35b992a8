"""Fused output projection + cross-entropy that never materialises the ``[tokens, vocab]`` logits.

``linear_cross_entropy(hidden [N, d], weight [V, d], target [N]) == cross_entropy(hidden @ weight.T, target)``
computed a chunk of ``C`` tokens at a time. For each chunk:

1. ``logits = hidden[c] @ weight.T`` -- ``[C, V]`` in the hidden dtype (a vendor GEMM: cuBLAS / hipBLASLt);
2. the Triton cross-entropy kernel (``cross_entropy_rows.py``) streams each row once for an online fp32
   logsumexp and the row's loss, then overwrites the row with its gradient
   ``(softmax - onehot) / n_valid`` (zero for ``ignore_index`` tokens);
3. ``d_hidden[c] = dlogits @ weight`` and ``d_weight += dlogits.T @ hidden[c]`` (in place, ``addmm_``).

The gradients are thus computed in the forward (3 GEMMs in all, no recompute) and only scaled by the
incoming gradient in the backward; without grad mode (or when neither input needs a gradient) step 3
is skipped and the kernel only reads the logits.

Memory bound, beyond the inputs: ``C * V`` elements of the hidden dtype for the chunk's logits (reused
for their gradient), ``N * d`` for ``d_hidden`` and ``V * d`` for ``d_weight`` (each input's dtype), and
8 bytes a token (fp32 loss and lse). The default ``C`` keeps the chunk within ``CHUNK_BUDGET_BYTES``
(256 MiB: 1024 tokens at vocab 128256 in bf16), against at least ``N * V * (2 + 4)`` bytes (bf16 logits
and their fp32 copy; the log-softmax and the gradients add more) for
``F.cross_entropy(F.linear(hidden, weight).float(), target)``: 5.9 GiB at N = 8192 tokens.

Precision: logits are rounded to the hidden dtype before the fp32 softmax, as in the unfused bf16 path.
``d_weight`` is accumulated over chunks in the weight's dtype (each ``addmm_`` sums in fp32 inside the
GEMM, then rounds once per chunk). The backward scales the saved gradients in place, so the graph can
be backpropagated once (no ``retain_graph`` re-use, no double backward).
"""

from __future__ import annotations

import torch

from primus.turbo.triton.cross_entropy_rows import ce_rows, valid_count

CHUNK_BUDGET_BYTES = 256 * 2**20
MIN_CHUNK = 128  # below this the GEMMs get thin and slow


def default_chunk_size(n_tokens: int, vocab: int, element_size: int, budget: int = CHUNK_BUDGET_BYTES) -> int:
    """Tokens per chunk: the most whose ``[C, vocab]`` logits fit ``budget`` bytes, rounded down to a
    multiple of ``MIN_CHUNK`` (at least ``MIN_CHUNK``), and no more than ``n_tokens``."""
    fit = budget // (vocab * element_size)
    return max(1, min(n_tokens, max(MIN_CHUNK, fit // MIN_CHUNK * MIN_CHUNK)))


def _loss_and_grads(hidden, weight, target, ignore_index: int, chunk: int, block: int | None, need_dh, need_dw):
    """The chunk loop: mean loss (fp32) and, where asked, the gradients of the mean loss."""
    n_valid = valid_count(target, ignore_index)
    scale = (1.0 / n_valid.float()).reshape(1) if (need_dh or need_dw) else None
    loss = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(loss)
    d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_dh else None
    d_weight = torch.zeros_like(weight) if need_dw else None
    for start in range(0, hidden.shape[0], chunk):
        end = min(start + chunk, hidden.shape[0])
        h = hidden[start:end]
        logits = h @ weight.T  # [c, V]; becomes its own gradient below
        ce_rows(logits, target[start:end], ignore_index, loss[start:end], lse[start:end], scale, block)
        if need_dh:
            torch.mm(logits, weight, out=d_hidden[start:end])
        if need_dw:
            d_weight.addmm_(logits.T, h)
        del logits
    return loss.sum() / n_valid, d_hidden, d_weight


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int,
        chunk_size: int | None,
        block: int | None = None,
    ) -> torch.Tensor:
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(
                f"linear_cross_entropy: hidden [N, d] and weight [V, d] expected, got {list(hidden.shape)} and "
                f"{list(weight.shape)}"
            )
        if hidden.dtype != weight.dtype:
            raise ValueError(f"linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}")
        target = target.reshape(-1)
        if target.numel() != hidden.shape[0]:
            raise ValueError(f"linear_cross_entropy: {target.numel()} targets for {hidden.shape[0]} tokens")
        chunk = chunk_size or default_chunk_size(hidden.shape[0], weight.shape[0], hidden.element_size())
        # The GEMMs run in the inputs' dtype (under autocast the gradient buffers would not take its products).
        with torch.autocast(hidden.device.type, enabled=False):
            loss, d_hidden, d_weight = _loss_and_grads(
                hidden, weight, target, ignore_index, chunk, block, *ctx.needs_input_grad[:2]
            )
        ctx.save_for_backward(d_hidden, d_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        d_hidden, d_weight = ctx.saved_tensors
        for grad in (d_hidden, d_weight):
            if grad is not None:
                grad.mul_(grad_out.to(grad.dtype))
        return d_hidden, d_weight, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden [N, d] @ weight[V, d].T`` against ``target [N]`` without the
    ``[N, V]`` logits: at most ``chunk_size * V`` logits live at once (see the module docstring for the
    full memory bound; default chunk from :func:`default_chunk_size`). ``hidden [..., d]`` with
    ``target [...]`` is flattened to tokens. fp32 loss; hidden and weight share one dtype (autocast does
    not apply inside)."""
    return LinearCrossEntropyFunction.apply(hidden.flatten(0, -2), weight, target.flatten(), ignore_index, chunk_size)
