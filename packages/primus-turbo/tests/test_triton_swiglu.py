"""Triton SwiGLU against core's fp32 reference: forward and backward, sizes off the block grid."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus.core.kernels import reference  # noqa: E402
from primus.turbo.triton import swiglu as kernels  # noqa: E402


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((3, 2100), torch.float32), ((2, 5, 96), torch.float32), ((4, 1100), torch.bfloat16)],
    ids=["cols-off-the-block", "small", "bf16"],
)
def test_swiglu_matches_reference(device, assert_matches, shape, dtype):
    torch.manual_seed(0)
    gate, up = (torch.randn(shape, device=device).mul(3).to(dtype).requires_grad_() for _ in range(2))
    gate_r, up_r = (t.detach().float().requires_grad_() for t in (gate, up))
    grad = torch.randn(shape, device=device).to(dtype)

    out = kernels.swiglu(gate, up)
    out.backward(grad)
    ref = reference.swiglu(gate_r, up_r)
    ref.backward(grad.float())

    assert out.dtype == dtype
    assert_matches(out, ref, dtype)
    assert_matches(gate.grad, gate_r.grad, dtype)
    assert_matches(up.grad, up_r.grad, dtype)


def test_swiglu_takes_strided_halves_of_one_projection(device, assert_matches):
    torch.manual_seed(1)
    fused = torch.randn(3, 2, 2 * 2100, device=device, requires_grad=True)  # [s, b, 2 * ffn], ffn > BLOCK
    gate, up = fused.chunk(2, dim=-1)  # non-contiguous views, as megatron's fused fc1 gives
    assert kernels._row_view(gate).data_ptr() == gate.data_ptr()  # read in place, not copied
    out = kernels.swiglu(gate, up)
    out.sum().backward()
    ref_in = fused.detach().clone().requires_grad_()
    reference.swiglu(*ref_in.chunk(2, dim=-1)).sum().backward()
    assert_matches(out, reference.swiglu(*fused.detach().chunk(2, dim=-1)))
    assert_matches(fused.grad, ref_in.grad)


def test_layouts_that_do_not_flatten_are_copied(device, assert_matches):
    gate = torch.randn(4, 6, 8, device=device).transpose(0, 1)  # [6, 4, 8]: rows do not share one stride
    up = torch.randn(6, 4, 8, device=device)
    assert_matches(kernels.swiglu(gate, up), reference.swiglu(gate, up))


def test_mismatched_inputs_are_refused(device):
    with pytest.raises(ValueError, match="differ"):
        kernels.swiglu(torch.zeros(4, device=device), torch.zeros(5, device=device))


@pytest.mark.parametrize(
    ("shape", "dtype"), [((3, 2, 2 * 2100), torch.float32), ((4, 2 * 1100), torch.bfloat16)], ids=["fp32", "bf16"]
)
def test_packed_swiglu_matches_reference_and_returns_the_gradient_in_one_tensor(device, assert_matches, shape, dtype):
    torch.manual_seed(2)
    x = torch.randn(shape, device=device).mul(3).to(dtype).requires_grad_()
    x_r = x.detach().float().requires_grad_()
    grad = torch.randn((*shape[:-1], shape[-1] // 2), device=device).to(dtype)
    assert kernels.swiglu.packed is kernels.swiglu_packed  # the provider's callable offers it

    out = kernels.swiglu_packed(x)
    out.backward(grad)
    ref = reference.swiglu(*x_r.chunk(2, dim=-1))
    ref.backward(grad.float())
    assert out.dtype == dtype and out.shape == ref.shape
    assert_matches(out, ref, dtype)
    assert_matches(x.grad, x_r.grad, dtype)  # gate half first, then up


def test_packed_swiglu_backward_has_no_concatenation(device):
    """The chunked form's gradient goes through autograd's chunk backward (a cat); the packed one's does not."""
    x = torch.randn(4, 2 * 96, device=device, requires_grad=True)
    packed = kernels.swiglu_packed(x)
    chunked = kernels.swiglu(*x.chunk(2, dim=-1))
    assert packed.grad_fn.next_functions[0][0].__class__.__name__ == "AccumulateGrad"
    assert "Split" in chunked.grad_fn.next_functions[0][0].__class__.__name__


def test_packed_swiglu_refuses_an_odd_width(device):
    with pytest.raises(ValueError, match="even"):
        kernels.swiglu_packed(torch.zeros(2, 7, device=device))
