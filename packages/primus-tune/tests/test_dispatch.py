"""Dispatch: each of a linear's three GEMMs goes to its own tuned entry when there is one, else to torch, and
values and gradients match F.linear. The tuned GEMMs here are plain-torch stand-ins that compute in float64
(numerically matching; the CUDA provider, nvmath, is exercised on the GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from primus.tune.dispatch import StaticPlans, patch_linears, tuned_linear
from primus.tune.shapes import linear_gemms


def _exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a.double(), b.double()).to(a.dtype)


def _plans_for(tokens: int, n_in: int, n_out: int, which=(0, 1, 2)) -> StaticPlans:
    gemms = linear_gemms(tokens, n_in, n_out, dtype="float32")
    return StaticPlans({gemms[i].key: _exact for i in which})


def test_forward_and_both_backward_gemms_dispatch_and_match_f_linear():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16, requires_grad=True)
    w = torch.randn(24, 16, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    plans = _plans_for(12, 16, 24)

    y = tuned_linear(x, w, b, plans)
    g = torch.randn_like(y)
    y.backward(g)
    got = (y.detach(), x.grad.clone(), w.grad.clone(), b.grad.clone())

    x.grad = w.grad = b.grad = None
    ref = F.linear(x, w, b)
    ref.backward(g)
    for a, e in zip(got, (ref.detach(), x.grad, w.grad, b.grad), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    fwd, dgrad, wgrad = linear_gemms(12, 16, 24, dtype="float32")
    assert plans.hits == {fwd.key: 1, dgrad.key: 1, wgrad.key: 1}
    assert y.shape == (2, 6, 24)


def test_only_the_gemms_that_won_are_routed():
    x = torch.randn(12, 16, requires_grad=True)
    w = torch.randn(24, 16, requires_grad=True)
    plans = _plans_for(12, 16, 24, which=(2,))  # only the weight gradient was tuned
    tuned_linear(x, w, None, plans).sum().backward()
    fwd, dgrad, wgrad = linear_gemms(12, 16, 24, dtype="float32")
    assert plans.hits == {wgrad.key: 1}
    assert set(plans.misses) == {fwd.key, dgrad.key}  # seen, searched online later


def test_gradcheck_in_double():
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    gemms = linear_gemms(5, 4, 3, dtype="float64")
    plans = StaticPlans({g.key: _exact for g in gemms})
    assert torch.autograd.gradcheck(lambda x, w, b: tuned_linear(x, w, b, plans), (x, w, b))


def test_unusual_inputs_fall_back_to_f_linear():
    plans = StaticPlans()
    w = torch.randn(8, 4)
    x16 = torch.randn(3, 4, dtype=torch.bfloat16)
    torch.testing.assert_close(tuned_linear(x16, w.bfloat16(), None, None), F.linear(x16, w.bfloat16()))
    mixed = tuned_linear(torch.randn(3, 4, dtype=torch.float64), w.double(), None, plans)
    assert mixed.shape == (3, 8)
    x1d = torch.randn(4)
    torch.testing.assert_close(tuned_linear(x1d, w, None, plans), F.linear(x1d, w))
    assert not plans.hits


def test_patched_model_trains_like_the_original():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16, bias=False))
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16, bias=False))
    model.load_state_dict(ref.state_dict())
    gemms = linear_gemms(8, 16, 32, dtype="float32") + linear_gemms(8, 32, 16, dtype="float32")
    plans = StaticPlans({g.key: _exact for g in gemms})
    assert patch_linears(model, plans) == 2
    x = torch.randn(8, 16)
    for m in (ref, model):
        m(x).square().mean().backward()
    for p_ref, p in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6)
    assert sum(plans.hits.values()) == 5  # 2 forwards, 2 weight grads, 1 input grad (x needs none)


def test_autocast_casts_first_so_the_bf16_gemms_are_looked_up():
    x = torch.randn(12, 16, requires_grad=True)
    w = torch.randn(24, 16, requires_grad=True)
    gemms = linear_gemms(12, 16, 24, dtype="bfloat16")
    plans = StaticPlans({g.key: _exact for g in gemms})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tuned_linear(x, w, None, plans)
        ref = F.linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref)
    y.float().sum().backward()
    assert plans.hits == {g.key: 1 for g in gemms} and w.grad.dtype == torch.float32


def test_direct_launch_needs_nvmaths_planned_matmul_attributes():
    """The direct cuBLASLt launch reads a planned nvmath Matmul's handle, descriptors and buffers; a Matmul without
    them (another nvmath version, or not planned) keeps Matmul.execute instead of failing."""
    from types import SimpleNamespace

    from primus.tune.dispatch import DirectLaunch

    assert DirectLaunch.of(SimpleNamespace()) is None
    planned_not = SimpleNamespace(**dict.fromkeys(DirectLaunch.ATTRS, 1), algorithms_buffer=None)
    assert DirectLaunch.of(planned_not) is None
