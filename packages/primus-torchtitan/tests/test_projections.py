"""q/k/v and gate/up projections fused into one GEMM each (primus.torchtitan.projections).

The fused model keeps torchtitan's parameters and state-dict keys and computes what torchtitan's own modules
compute, gradients included (llama3's attention, the qkv-bias attention of Primus's dense registration,
qwen3's feed-forward); this also holds the fused attention forward to torchtitan 0.2.2's. FP8 linears and
tensor parallelism are left unfused; ``kernels.fuse_projections: false`` turns it off.
"""

from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from test_kernels import counting, tiny_model

from primus.core.config.schema import PrimusConfig
from primus.torchtitan.kernels import plan, swap_modules
from primus.torchtitan.projections import FusedAttention, fuse_projections, project, refusal
from primus.torchtitan.runner import kernel_plan


def sharpen(model: torch.nn.Module) -> None:
    """Weights large enough for peaked attention and biases that are not zero: a wrong q/k/v slice or a dropped
    bias shows in the outputs (torchtitan's init, std 0.02, leaves attention near uniform)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif p.dim() == 2:
                p.normal_(0, 2 / p.shape[1] ** 0.5)


@pytest.mark.parametrize(
    ("name", "counts"),
    [
        ("tiny-llama", {"attention": 2, "feed_forward": 2}),
        ("tiny-qwen2", {"attention": 2, "feed_forward": 2}),  # q/k/v biases: concatenated with the weights
        ("tiny-qwen3", {"attention": 0, "feed_forward": 2}),  # qwen3's attention (q/k norms) is its own class
    ],
)
def test_fused_model_gives_torchtitans_outputs_and_gradients(name, counts):
    model = tiny_model(name)
    sharpen(model)
    fused = copy.deepcopy(model)
    params = dict(fused.named_parameters())
    assert fuse_projections(fused) == counts
    assert all(p is params[n] for n, p in fused.named_parameters())
    assert list(fused.state_dict()) == list(model.state_dict())
    if counts["attention"]:
        assert type(fused.layers["0"].attention) is FusedAttention
    tokens = torch.randint(0, 2048, (2, 32))
    want, got = model(tokens), fused(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().mean().backward()
    want.square().mean().backward()
    for (n, a), b in zip(fused.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_project_is_one_gemm_whose_outputs_are_views():
    linears = [torch.nn.Linear(8, n, bias=False) for n in (8, 4, 4)]
    x = torch.randn(3, 8)
    outs = project(x, linears)
    assert [o.shape[-1] for o in outs] == [8, 4, 4]
    assert outs[1]._base is outs[0]._base is not None  # slices of one GEMM output
    for o, lin in zip(outs, linears, strict=True):
        torch.testing.assert_close(o, lin(x))


def test_fp8_linears_and_mixed_biases_stay_unfused():
    class Fp8Linear(torch.nn.Linear):  # stands in for an FP8 swap's module: its own GEMM
        pass

    model = tiny_model()
    attn0 = model.layers["0"].attention
    attn0.wk = Fp8Linear(attn0.wk.in_features, attn0.wk.out_features, bias=False)
    ff1 = model.layers["1"].feed_forward
    ff1.w3 = torch.nn.Linear(ff1.w3.in_features, ff1.w3.out_features, bias=True)  # w1 has none
    assert fuse_projections(model) == {"attention": 1, "feed_forward": 1}
    assert type(attn0) is not FusedAttention and type(model.layers["1"].attention) is FusedAttention
    assert type(ff1).__name__ == "FeedForward"


def test_fused_feed_forward_calls_the_swiglu_provider():
    calls: Counter = Counter()
    model = tiny_model()
    swap_modules(model, plan(counting(calls), family="llama", tp=1, cp=1, loss_parallel=True))
    assert fuse_projections(model) == {"attention": 2, "feed_forward": 2}
    model(torch.randint(0, 2048, (1, 16)))
    assert calls == {"rms_norm": 5, "attention": 2, "swiglu": 2}


@pytest.mark.parametrize(
    ("overrides", "fused"),
    [({}, True), ({"kernels": {"fuse_projections": False}}, None), ({"parallel": {"tp": 2}}, False)],
)
def test_config_switch_and_tensor_parallel_refusal(overrides, fused):
    cfg = PrimusConfig.model_validate({"model": {"family": "llama"}, **overrides})
    choice = kernel_plan(cfg, SimpleNamespace(kernels={})).get("fuse_projections")
    if fused is None:
        assert choice is None
    else:
        assert (choice.fn is fuse_projections) is fused
        assert choice.note == (refusal(tp=2) if not fused else choice.note)
    assert refusal(tp=2) and not refusal(tp=1)
