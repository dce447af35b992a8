"""Triton MoE router (scores, top-k, weights) against core's fp32 reference, TorchTitan's own router math."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus.core.kernels import reference  # noqa: E402
from primus.turbo.triton import moe_router as kernels  # noqa: E402


@pytest.mark.parametrize(
    ("experts", "k", "score", "normalize", "bias", "dtype"),
    [
        (8, 2, "softmax", False, False, torch.float32),  # Mixtral: softmax, the top 2's softmax weights
        (128, 8, "softmax", True, False, torch.float32),  # Qwen3-MoE: renormalised over the top 8
        (64, 6, "sigmoid", True, True, torch.float32),  # DeepSeek-V3 style: sigmoid, loss-free bias, renormalised
        (40, 3, "softmax", True, True, torch.bfloat16),  # experts off a power of two, bf16 logits
    ],
    ids=["mixtral", "qwen3", "sigmoid-bias", "bf16-odd-experts"],
)
def test_router_matches_reference(device, assert_matches, experts, k, score, normalize, bias, dtype):
    torch.manual_seed(0)
    tokens = 33
    logits = (torch.randn(tokens, experts, device=device) * 2).to(dtype).requires_grad_()
    expert_bias = torch.randn(experts, device=device) * 0.05 if bias else None
    options = {"score": score, "bias": expert_bias, "normalize": normalize, "scale": 2.5}

    probs, indices = kernels.moe_router(logits, k, **options)
    ref_logits = logits.detach().float().requires_grad_()
    ref_probs, ref_indices = reference.moe_router(ref_logits, k, **options)
    # the same experts per token (the kernel picks in descending order; torch's topk order is not part of the contract)
    order, ref_order = indices.argsort(dim=1), ref_indices.argsort(dim=1)
    assert torch.equal(indices.gather(1, order), ref_indices.gather(1, ref_order))
    assert probs.dtype == torch.float32 and indices.dtype == torch.int64
    assert_matches(probs.gather(1, order), ref_probs.gather(1, ref_order))
    grad = torch.randn(tokens, k, device=device)
    probs.backward(grad)
    ref_probs.backward(grad.gather(1, order).scatter(1, ref_order, grad.gather(1, order)))  # the same pairs
    assert logits.grad.dtype == dtype
    assert_matches(logits.grad, ref_logits.grad, dtype)


def test_bias_chooses_but_does_not_weigh(device):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=device)
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0], device=device)
    probs, indices = kernels.moe_router(logits, 1, bias=bias)
    assert indices.tolist() == [[2]]
    assert probs.item() == pytest.approx(torch.softmax(logits, -1)[0, 2].item(), rel=1e-6)


def test_refuses_what_it_cannot_hold(device):
    with pytest.raises(ValueError, match="top-k 9 must be within 1..8 experts"):
        kernels.moe_router(torch.zeros(2, 8, device=device), 9)
    with pytest.raises(ValueError, match="score 'relu'; allowed: softmax, sigmoid"):
        kernels.moe_router(torch.zeros(2, 8, device=device), 2, score="relu")
