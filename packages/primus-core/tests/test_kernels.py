"""Core's plain-PyTorch kernels against textbook math, and provider selection."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from primus.core import hookimpl  # noqa: E402
from primus.core.config.schema import KernelsConfig  # noqa: E402
from primus.core.kernels import reference as ref  # noqa: E402
from primus.core.kernels.selection import KernelUnavailable, select_kernels  # noqa: E402


def test_gqa_attention_matches_explicit_math():
    g = torch.Generator().manual_seed(0)
    b, h, hkv, s, d = 2, 8, 2, 16, 32
    q, k, v = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv))
    out = ref.attention(q, k, v, causal=True)
    kr, vr = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    scores = q @ kr.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    expect = scores.softmax(-1) @ vr
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-10)


def test_rms_norm_swiglu_rope_cross_entropy():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 5, 16, generator=g), torch.randn(16, generator=g)
    expect = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6), expect)
    a, b = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    torch.testing.assert_close(ref.swiglu(a, b), a / (1 + torch.exp(-a)) * b)
    # rope with angle 0 is the identity; with angle θ on a pair (x1, x2) it rotates by θ
    x = torch.randn(1, 2, 1, 4, generator=g)
    torch.testing.assert_close(ref.rope(x, torch.ones(2, 4), torch.zeros(2, 4)), x)
    theta = 0.3
    cos, sin = torch.full((2, 4), math.cos(theta)), torch.full((2, 4), math.sin(theta))
    y = ref.rope(x, cos, sin)
    x1, x2 = x[..., :2], x[..., 2:]
    torch.testing.assert_close(y[..., :2], x1 * math.cos(theta) - x2 * math.sin(theta))
    logits, target = torch.randn(6, 10, generator=g), torch.tensor([1, 2, 3, -100, 4, 5])
    keep = target != -100
    manual = -(logits.log_softmax(-1)[keep, target[keep]]).mean()
    torch.testing.assert_close(ref.cross_entropy(logits, target), manual)


def test_grouped_gemm_is_each_tokens_expert_linear():
    """Token t of group g gets w[g] @ x[t]; an empty group and rows past offs[-1] (zero) included; gradients too."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)
    expert = [0, 0, 2, 2, 2, 2, 2]
    y = ref.grouped_gemm(x, w, offs)
    expect = torch.stack([w[e] @ x[t] for t, e in enumerate(expert)] + [torch.zeros(4, dtype=x.dtype)] * 2)
    torch.testing.assert_close(y, expect, rtol=0, atol=1e-12)
    dy = torch.randn(9, 4, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, w), dy)
    want = torch.autograd.grad(expect, (x, w), dy)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert got[1][1].abs().max() == 0  # the empty group's weight gets no gradient


def test_moe_permute_gathers_tokens_by_expert_and_weights_them_back():
    """routed[i] = x[order[i] // k]; out[t] = sum_j probs[t, j] * routed[slot t*k + j]; gradients of both."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([[2, 0], [0, 1], [2, 1], [1, 0], [2, 0]])
    order = torch.argsort(indices.reshape(-1), stable=True)
    routed = ref.moe_permute(x, order, 2)
    by_expert = [t for e in range(3) for t in range(5) for j in range(2) if indices[t, j] == e]
    torch.testing.assert_close(routed, x[by_expert], rtol=0, atol=0)
    y = routed * torch.arange(1.0, 11.0, dtype=torch.float64)[:, None]  # each routed row its own factor
    out = ref.moe_permute.unpermute(y, order, probs)
    where = {int(s): i for i, s in enumerate(order)}  # slot -> routed row
    expect = torch.stack([sum(probs[t, j] * y[where[t * 2 + j]] for j in range(2)) for t in range(5)])
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)  # accumulated in fp32, as TorchTitan does
    dy = torch.randn(5, 3, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (x, probs), dy, retain_graph=True)  # y is shared by both graphs
    for a, b in zip(got, torch.autograd.grad(expect, (x, probs), dy), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_auto_selects_core_providers_on_cpu(registry, caplog):
    with caplog.at_level("DEBUG", logger="primus.kernels"):
        chosen = select_kernels(KernelsConfig(), registry, "cpu")
    assert chosen["attention"].name == "sdpa" and chosen["rms_norm"].name == "torch"
    assert "attention: sdpa (auto)" in caplog.messages
    assert chosen["attention"].load() is ref.attention


def test_a_dense_model_selects_no_grouped_gemm(registry, caplog):
    with caplog.at_level("INFO", logger="primus.kernels"):
        dense = select_kernels(KernelsConfig(), registry, "cpu", moe=False)
    assert "grouped_gemm" not in dense and not any("grouped_gemm" in m for m in caplog.messages)
    assert select_kernels(KernelsConfig(), registry, "cpu")["grouped_gemm"].name in ("torch", "grouped_mm")


def test_unknown_provider_by_name_is_an_error(registry):
    with pytest.raises(KernelUnavailable, match="kernels.attention: no provider named 'nope'"):
        select_kernels(KernelsConfig(attention="nope"), registry, "cpu")


def test_document_attention_is_causal_attention_within_each_document():
    """data.document_mask: documents end at EOS (the EOS belongs to the one it ends); attention over a packed sample
    equals causal attention over each document alone."""
    from primus.core.kernels.documents import document_ids

    eos = 0
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4], [0, 3, 3, 3, 3, 0, 0, 2]])
    docs = document_ids(tokens, eos)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 2, 3]]
    g = torch.Generator().manual_seed(2)
    b, h, hkv, s, d = 2, 4, 2, 8, 16
    q, k, v = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv))
    out = ref.attention(q, k, v, documents=docs)
    for i in range(b):
        for doc in docs[i].unique():
            at = (docs[i] == doc).nonzero().flatten()
            alone = ref.attention(q[i : i + 1, :, at], k[i : i + 1, :, at], v[i : i + 1, :, at])
            torch.testing.assert_close(out[i : i + 1, :, at], alone, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(out, ref.attention(q, k, v))  # the mask changed something


class _FastAttention:
    """An attention provider above core's that cannot mask by document."""

    @staticmethod
    @hookimpl
    def primus_kernels():
        from primus.core.contracts.protocols import KernelProvider

        fast = KernelProvider(op="attention", name="fast", impl=ref.attention, available=ref.always, priority=10)
        return [fast]


def test_document_mask_selects_only_providers_that_mask_by_document(monkeypatch):
    from primus.core.contracts.plugins import DISABLE_ENV, Registry, build_plugin_manager

    monkeypatch.setenv(DISABLE_ENV, "1")
    registry = Registry(build_plugin_manager(extra_plugins=[("fast", _FastAttention)]))
    assert select_kernels(KernelsConfig(), registry, "cpu")["attention"].name == "fast"
    assert select_kernels(KernelsConfig(), registry, "cpu", documents=True)["attention"].name == "sdpa"
    with pytest.raises(KernelUnavailable, match=r"provider 'fast' .* cannot mask attention by document"):
        select_kernels(KernelsConfig(attention="fast"), registry, "cpu", documents=True)


class _RingAttention:
    """An attention provider with the context_parallel feature."""

    @staticmethod
    @hookimpl
    def primus_kernels():
        from primus.core.contracts.protocols import CONTEXT_PARALLEL, KernelProvider

        ring = KernelProvider(
            op="attention",
            name="ring",
            impl=ref.attention,
            available=ref.always,
            features=frozenset({CONTEXT_PARALLEL}),
        )
        return [ring]


def test_context_parallelism_refuses_a_whole_sequence_attention_once_for_every_backend(monkeypatch):
    from primus.core.config.schema import PrimusConfig
    from primus.core.contracts.plugins import DISABLE_ENV, Registry, build_plugin_manager
    from primus.core.kernels.selection import cp_attention_issues

    monkeypatch.setenv(DISABLE_ENV, "1")
    bare = Registry(build_plugin_manager())
    ring = Registry(build_plugin_manager(extra_plugins=[("ring", _RingAttention)]))

    def cfg(cp: int, attention: str = "auto") -> PrimusConfig:
        return PrimusConfig.model_validate({"parallel": {"cp": cp}, "kernels": {"attention": attention}})

    assert cp_attention_issues(cfg(1, "sdpa"), bare) == []
    # an engine with no context-parallel attention of its own, and no provider that has one
    (issue,) = cp_attention_issues(cfg(2), bare)
    assert (issue.path, issue.value, issue.allowed) == ("parallel.cp", 2, "1, or install primus-turbo")
    assert cp_attention_issues(cfg(2), ring) == cp_attention_issues(cfg(2, "ring"), ring) == []
    (issue,) = cp_attention_issues(cfg(2, "sdpa"), ring)
    assert (issue.path, issue.value, issue.allowed) == ("kernels.attention", "sdpa", "auto, ring")
    assert "attends over the whole sequence on one device" in issue.message
    # an engine whose own attention runs context-parallel (TorchTitan's under torch's CP SDPA): it is allowed
    assert cp_attention_issues(cfg(2, "torch"), bare, own="torch") == []
    assert cp_attention_issues(cfg(2, "sdpa"), bare, own="torch")[0].allowed == "auto, torch"
