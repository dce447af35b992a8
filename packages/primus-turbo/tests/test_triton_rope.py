"""Triton rotate-half RoPE against core's fp32 reference: forward and backward, head_dim 64 and 128."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus.core.kernels import reference  # noqa: E402
from primus.turbo.triton import rope as kernels  # noqa: E402


def rotary_tables(seq: int, dim: int, device, base: float = 10000.0):
    """The usual cos/sin tables, [s, d], each frequency used by both halves."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize(
    ("b", "s", "h", "d", "dtype"),
    [(2, 5, 3, 64, torch.float32), (1, 4, 2, 128, torch.float32), (2, 3, 4, 64, torch.bfloat16)],
    ids=["d64", "d128", "bf16-d64"],
)
def test_rope_matches_reference(device, assert_matches, b, s, h, d, dtype):
    torch.manual_seed(0)
    cos, sin = rotary_tables(s, d, device)
    x = torch.randn(b, s, h, d, device=device).to(dtype).requires_grad_()
    x_r = x.detach().float().requires_grad_()
    grad = torch.randn(b, s, h, d, device=device).to(dtype)

    out = kernels.rope(x, cos, sin)
    out.backward(grad)
    ref = reference.rope(x_r, cos, sin)
    ref.backward(grad.float())

    assert out.dtype == dtype and out.shape == x.shape
    assert_matches(out, ref, dtype)
    assert_matches(x.grad, x_r.grad, dtype)


def test_rope_with_unrelated_halves_and_a_strided_input(device, assert_matches):
    """cos/sin whose two halves differ (the contract is a full [s, d] table), and q taken from a fused
    qkv tensor (a view whose heads are not contiguous with each other)."""
    torch.manual_seed(1)
    b, s, h, d = 2, 3, 5, 64
    cos, sin = torch.randn(s, d, device=device), torch.randn(s, d, device=device)
    qkv = torch.randn(b, s, 3 * h, d, device=device, requires_grad=True)
    q = qkv[:, :, h : 2 * h]
    assert not q.is_contiguous()
    out = kernels.rope(q, cos, sin)
    out.backward(torch.ones_like(out))
    qkv_r = qkv.detach().clone().requires_grad_()
    ref = reference.rope(qkv_r[:, :, h : 2 * h], cos, sin)
    ref.backward(torch.ones_like(ref))
    assert_matches(out, ref)
    assert_matches(qkv.grad, qkv_r.grad)


def test_rope_refuses_tables_of_another_shape(device):
    x = torch.zeros(1, 4, 2, 64, device=device)
    with pytest.raises(ValueError, match="cos/sin"):
        kernels.rope(x, torch.zeros(8, 64, device=device), torch.zeros(8, 64, device=device))
