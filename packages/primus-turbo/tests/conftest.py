from __future__ import annotations

import sys
import types

import pytest
import torch

from primus.core.plugins import Registry, build_plugin_manager


@pytest.fixture
def registry() -> Registry:
    """Everything the installed ``primus`` entry points offer (primus-core and primus-turbo here)."""
    return Registry(build_plugin_manager())


@pytest.fixture
def fake_aiter(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A stand-in ``aiter`` module (AITER needs an AMD GPU) computing what ``aiter.flash_attn_func``
    documents: q ``(b, s, h, d)``, k/v ``(b, s, h_kv, d)``, default scale ``d ** -0.5``. Records each call."""
    calls: list[dict] = []

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
        calls.append(
            {
                "q": q.shape,
                "k": k.shape,
                "dropout_p": dropout_p,
                "softmax_scale": softmax_scale,
                "causal": causal,
                **kwargs,
            }
        )
        b, s, h, d = q.shape
        qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))  # [b, h, s, d]
        rep = h // k.shape[2]
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
        scores = qh @ kh.transpose(-1, -2) * (softmax_scale if softmax_scale is not None else d**-0.5)
        if causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        return (scores.softmax(-1) @ vh).to(q.dtype).transpose(1, 2)  # back to (b, s, h, d)

    module = types.ModuleType("aiter")
    module.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "aiter", module)
    return types.SimpleNamespace(module=module, calls=calls)


@pytest.fixture
def rocm_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this torch look like a ROCm build (``torch.version.hip`` set), as on an AMD GPU machine."""
    monkeypatch.setattr(torch.version, "hip", "6.4.43482", raising=False)
