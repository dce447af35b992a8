"""Triton RMSNorm and fused add + RMSNorm against core's fp32 reference: forward and backward."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus.core.kernels import reference  # noqa: E402
from primus.turbo.triton import rms_norm as kernels  # noqa: E402


def leaves(device, dtype, *shapes):
    """Random leaves in ``dtype`` and their fp32 copies (the reference sees exactly the rounded values)."""
    xs = [torch.randn(s, device=device).to(dtype).requires_grad_() for s in shapes]
    return xs, [x.detach().float().requires_grad_() for x in xs]


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((3, 5, 96), torch.float32), ((7, 64), torch.float32), ((2, 9, 160), torch.bfloat16)],
    ids=["rows15-d96", "rows7-d64", "bf16-d160"],
)
def test_rms_norm_matches_reference(device, assert_matches, shape, dtype):
    torch.manual_seed(0)
    (x, w), (xr, wr) = leaves(device, dtype, shape, shape[-1:])
    grad = torch.randn(shape, device=device).to(dtype)

    y = kernels.rms_norm(x, w, 1e-6)
    y.backward(grad)
    yr = reference.rms_norm(xr, wr, 1e-6)
    yr.backward(grad.float())

    assert y.dtype == dtype and y.shape == shape
    assert_matches(y, yr, dtype)
    assert_matches(x.grad, xr.grad, dtype)
    # the weight gradient sums over rows: its error grows with the row count in low precision
    assert_matches(w.grad, wr.grad, dtype)


@pytest.mark.parametrize("use", ["both", "normed", "sum"])
def test_add_rms_norm_matches_unfused_pair(device, assert_matches, use):
    torch.manual_seed(1)
    shape = (4, 6, 80)
    (x, r, w), (xr, rr, wr) = leaves(device, torch.float32, shape, shape, shape[-1:])
    g_y, g_h = torch.randn(shape, device=device), torch.randn(shape, device=device)

    def loss(y, h):
        return {"both": (y * g_y).sum() + (h * g_h).sum(), "normed": (y * g_y).sum(), "sum": (h * g_h).sum()}[use]

    y, h = kernels.add_rms_norm(x, r, w, 1e-5)
    loss(y, h).backward()
    hr = xr + rr
    yr = reference.rms_norm(hr, wr, 1e-5)
    loss(yr, hr).backward()

    assert_matches(h, hr)
    assert_matches(y, yr)
    assert_matches(x.grad, xr.grad)
    assert_matches(r.grad, rr.grad)
    if use == "sum":
        assert w.grad is None or not w.grad.any()
    else:
        assert_matches(w.grad, wr.grad)


def test_add_rms_norm_rounds_the_sum_like_the_unfused_add(device):
    torch.manual_seed(2)
    x, r = (torch.randn(8, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(128, device=device, dtype=torch.bfloat16)
    y, h = kernels.add_rms_norm(x, r, w, 1e-6)
    if device.type == "cuda":
        assert torch.equal(h, x + r)  # bit for bit: both round the fp32 sum to nearest even
    else:  # the interpreter's fp32 -> bf16 cast truncates: at most one bf16 step (2**-7 relative) off
        exact = x.float() + r.float()
        assert ((h.float() - exact).abs() <= exact.abs() * 2**-7).all()
    torch.testing.assert_close(y.float(), reference.rms_norm((x + r).float(), w.float(), 1e-6), rtol=2e-2, atol=2e-2)


def test_fp32_weight_with_bf16_activations(device, assert_matches):
    """Weights kept in fp32 under bf16 activations: output and input gradient in bf16, weight gradient fp32."""
    torch.manual_seed(3)
    x = torch.randn(6, 64, device=device).to(torch.bfloat16).requires_grad_()
    w = torch.randn(64, device=device, requires_grad=True)
    x_r, w_r = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    y = kernels.rms_norm(x, w, 1e-6)
    y.float().sum().backward()
    reference.rms_norm(x_r, w_r, 1e-6).sum().backward()
    assert y.dtype == x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert_matches(y, reference.rms_norm(x_r.detach(), w_r.detach(), 1e-6), torch.bfloat16)
    assert_matches(x.grad, x_r.grad, torch.bfloat16)
    assert_matches(w.grad, w_r.grad, torch.bfloat16)


def test_rows_too_wide_for_registers_are_refused(device):
    x = torch.zeros(1, 40000, device=device)
    with pytest.raises(ValueError, match="exceed"):
        kernels.rms_norm(x, torch.ones(40000, device=device), 1e-6)
