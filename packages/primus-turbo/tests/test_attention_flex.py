"""The ``flex`` provider (FlexAttention): core's attention contract with ``documents=``, and its selection.

On CPU FlexAttention has no backward, so the provider is offered on GPUs only; its forward runs eagerly here and is
checked against core's reference. Its speed and the compiled kernels' error are benchmarks/document_attention_h200.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from primus.core.config.schema import KernelsConfig  # noqa: E402
from primus.core.kernels import reference as ref  # noqa: E402
from primus.core.kernels.documents import document_ids  # noqa: E402
from primus.core.kernels.selection import KernelUnavailable, select_kernels  # noqa: E402
from primus.turbo import availability  # noqa: E402
from primus.turbo.attention_flex import attention, block_mask  # noqa: E402


def test_forward_is_cores_reference_within_documents_and_causal():
    g = torch.Generator().manual_seed(0)
    b, h, hkv, s, d = 2, 4, 2, 256, 16  # two 128-token tiles: wholly masked tiles are skipped
    q, k, v = (torch.randn(b, n, s, d, generator=g) for n in (h, hkv, hkv))
    docs = document_ids(torch.randint(0, 40, (b, s), generator=g), eos_id=0)
    assert docs[:, -1].min() > 2  # several documents per sample
    with torch.no_grad():
        torch.testing.assert_close(attention(q, k, v, documents=docs), ref.attention(q, k, v, documents=docs))
        torch.testing.assert_close(attention(q, k, v, scale=0.3), ref.attention(q, k, v, scale=0.3))


def test_one_block_mask_per_micro_batch():
    docs = document_ids(torch.tensor([[1, 0, 2, 3] * 64]), eos_id=0)
    first = block_mask(docs, 256, docs.device)
    assert block_mask(docs, 256, docs.device) is first  # the next layer reuses it
    docs.add_(0)  # written in place (a new micro-batch in the same buffer): rebuilt
    assert block_mask(docs, 256, docs.device) is not first


def test_selected_for_document_masking_on_gpus_only(registry):
    kw = {"dtype": "bf16", "head_dim": 128}
    on_gpu = select_kernels(KernelsConfig(), registry, "cuda", documents=True, **kw)["attention"]
    assert on_gpu.name == "flex" and "documents" in on_gpu.features
    assert select_kernels(KernelsConfig(), registry, "cpu", documents=True, **kw)["attention"].name == "sdpa"
    with pytest.raises(KernelUnavailable, match="provider 'cudnn' .* cannot mask attention by document"):
        select_kernels(KernelsConfig(attention="cudnn"), registry, "cuda", documents=True, **kw)
    assert "document masking" in availability.flex("cuda").reason  # causal attention: cuDNN, flash, SDPA
    assert "no backward on CPU" in availability.flex("cpu", documents=True).reason
    assert "parallel.cp=2" in availability.flex("cuda", cp=2, documents=True).reason
    assert "power of two" in availability.flex("cuda", head_dim=96, documents=True).reason
