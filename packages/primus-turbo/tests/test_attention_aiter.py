"""The AITER provider's layout handling: Primus's [b, h, s, d] in, AITER's (b, s, h, d) to the library.

Runs against the stand-in ``aiter`` of conftest.py (the real library needs an AMD GPU); the reference
is core's plain-PyTorch attention.
"""

from __future__ import annotations

import pytest
import torch

from primus.core.kernels import reference
from primus.turbo import attention_aiter


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.2])
def test_matches_reference_with_gqa(fake_aiter, causal, scale):
    torch.manual_seed(0)
    b, h, h_kv, s, d = 2, 4, 2, 16, 8
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, h_kv, s, d), torch.randn(b, h_kv, s, d)

    out = attention_aiter.attention(q, k, v, causal=causal, scale=scale)

    torch.testing.assert_close(out, reference.attention(q, k, v, causal=causal, scale=scale))
    assert out.shape == (b, h, s, d)
    (call,) = fake_aiter.calls
    assert call["q"] == (b, s, h, d) and call["k"] == (b, s, h_kv, d)
    assert (call["dropout_p"], call["softmax_scale"], call["causal"]) == (0.0, scale, causal)
