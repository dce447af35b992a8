from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from primus.core.contracts.plugins import Registry, build_plugin_manager

# Without a GPU the Triton kernels run in Triton's interpreter (numpy, on CPU tensors). The flag is read
# when a kernel is defined, so it is set here, before any test imports primus.turbo.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Error bounds of the Triton kernels against core's references computed in fp32 (kernels do fp32 math;
# the low-precision bounds cover one rounding of inputs and outputs to the dtype, 2**-8 for bf16).
TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 5e-3, "atol": 5e-3},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


@pytest.fixture
def device() -> torch.device:
    """Where the Triton kernel tests run: the GPU when there is one, else CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def assert_matches():
    """``assert_matches(actual, expected, dtype)``: finite (NaN/inf never pass) and within the dtype's bounds
    of the fp32 reference."""

    def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        assert torch.isfinite(actual).all(), "non-finite values in the kernel's output"
        assert torch.isfinite(expected).all(), "non-finite values in the reference"
        torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])

    return check


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
