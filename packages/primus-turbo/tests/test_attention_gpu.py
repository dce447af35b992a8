"""The forced-backend SDPA providers on a real GPU: same result as core's reference, no silent fallback."""

from __future__ import annotations

import pytest
import torch

from primus.core.kernels import reference
from primus.turbo import attention_sdpa, availability

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.hip is not None,
    reason="needs an NVIDIA GPU (cuDNN and flash SDPA backends)",
)

PROVIDERS = {"cudnn": attention_sdpa.cudnn_attention, "flash": attention_sdpa.flash_attention}


@pytest.mark.parametrize("name", sorted(PROVIDERS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_and_backward_match_reference(name, head_dim):
    assert getattr(availability, name)("cuda", dtype="bf16", head_dim=head_dim)
    torch.manual_seed(0)
    b, h, h_kv, s = 2, 8, 2, 256
    shapes = [(b, h, s, head_dim), (b, h_kv, s, head_dim), (b, h_kv, s, head_dim)]
    inputs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for shape in shapes]
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    grad = torch.randn(b, h, s, head_dim, device="cuda", dtype=torch.bfloat16)

    out = PROVIDERS[name](*inputs, causal=True)
    out.backward(grad)
    ref = reference.attention(*ref_inputs, causal=True)
    ref.backward(grad.float())

    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for x, r in zip(inputs, ref_inputs, strict=True):
        torch.testing.assert_close(x.grad.float(), r.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("name", sorted(PROVIDERS))
def test_fp32_is_refused_not_silently_run_elsewhere(name):
    q = torch.randn(1, 2, 16, 64, device="cuda")
    with pytest.raises(RuntimeError):
        PROVIDERS[name](q, q, q)
