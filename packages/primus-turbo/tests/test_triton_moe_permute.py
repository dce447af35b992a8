"""Triton MoE permute / unpermute against a per-expert loop in fp32 (and core's reference): outputs and gradients."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus.core.kernels import reference  # noqa: E402
from primus.turbo.triton import moe_permute as kernels  # noqa: E402


def _routing(tokens: int, experts: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k distinct experts (one expert left idle) and the slots sorted by expert, as a router gives."""
    logits = torch.randn(tokens, experts, device=device)
    logits[:, 0] = -1e9  # expert 0 gets no token: an empty group
    indices = logits.topk(k, dim=1).indices
    return indices, torch.argsort(indices.reshape(-1), stable=True)


def _loop(x: torch.Tensor, indices: torch.Tensor, probs: torch.Tensor, experts: int, fn) -> torch.Tensor:
    """The layer by a loop over experts: each expert's tokens through ``fn(rows, expert)``, weighted back per token."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in range(experts):
        tok, j = (indices == e).nonzero(as_tuple=True)
        if tok.numel():
            out = out.index_add(0, tok, probs[tok, j, None].float() * fn(x[tok], e).float())
    return out


@pytest.mark.parametrize(
    ("tokens", "d", "k", "dtype"),
    [(37, 96, 2, torch.float32), (16, 1100, 3, torch.float32), (24, 128, 2, torch.bfloat16)],
    ids=["small", "cols-off-the-block", "bf16"],
)
def test_permute_and_unpermute_match_a_loop_over_experts(device, assert_matches, tokens, d, k, dtype):
    torch.manual_seed(0)
    experts = 6
    indices, order = _routing(tokens, experts, k, device)
    x = torch.randn(tokens, d, device=device).to(dtype).requires_grad_()
    probs = torch.rand(tokens, k, device=device).requires_grad_()
    scale = torch.arange(1, experts + 1, device=device, dtype=torch.float32)  # a different function per expert
    counts = torch.bincount(indices.reshape(-1), minlength=experts)
    group = torch.repeat_interleave(torch.arange(experts, device=device), counts)  # each routed row's expert

    routed = kernels.moe_permute(x, order, k)
    assert routed.dtype == dtype and routed.shape == (tokens * k, d)
    assert torch.equal(routed, x[order // k])  # a copy: exact
    out = kernels.unpermute(torch.tanh(routed.float() * scale[group, None]).to(dtype), order, probs)
    grad = torch.randn(tokens, d, device=device).to(dtype)
    out.backward(grad)

    x_r, probs_r = (t.detach().float().requires_grad_() for t in (x, probs))
    ref = _loop(x_r, indices, probs_r, experts, lambda rows, e: torch.tanh(rows * scale[e]))
    ref.backward(grad.float())
    assert out.dtype == dtype
    for got, want in ((out, ref), (x.grad, x_r.grad), (probs.grad, probs_r.grad)):
        assert_matches(got, want, dtype)


def test_matches_core_reference_in_fp32(device, assert_matches):
    """The same contract as core's plain-PyTorch provider (TorchTitan's own combine), gradients included."""
    torch.manual_seed(1)
    tokens, d, k, experts = 20, 64, 2, 4
    indices, order = _routing(tokens, experts, k, device)
    inputs = [torch.randn(tokens, d, device=device), torch.rand(tokens, k, device=device)]
    results = []
    for impl in (kernels.moe_permute, reference.moe_permute):
        x, probs = (t.clone().requires_grad_() for t in inputs)
        routed = impl(x, order, k)
        out = impl.unpermute(routed * 2.0 + 1.0, order, probs)
        out.pow(2).sum().backward()
        results.append((out, x.grad, probs.grad))
    for got, want in zip(*results, strict=True):
        assert_matches(got, want)


def test_no_tokens(device):
    x = torch.zeros(0, 8, device=device, requires_grad=True)
    order = torch.zeros(0, dtype=torch.int64, device=device)
    out = kernels.unpermute(kernels.moe_permute(x, order, 2), order, torch.zeros(0, 2, device=device))
    assert out.shape == (0, 8)
