"""Document-aware attention with PyTorch's FlexAttention (``torch.nn.attention.flex_attention``, compiled to Triton
kernels on the GPU): the ``flex`` provider, core's attention contract plus ``documents=[b, s]``.

Core's ``sdpa`` provider masks by document with a dense boolean ``[b, 1, s, s]`` mask (torch's memory-efficient
kernel: the mask is read for every score). FlexAttention takes the mask as a block mask instead: 128 × 128 tiles
that are wholly masked are skipped, so a packed sample of short documents costs less than a causal one
(``benchmarks/document_attention_h200.py``). Without ``documents`` it is plain causal attention (cuDNN and flash are
faster there and rank above it). The block mask is built once per micro-batch (the layers share one
``documents`` tensor) and reused by every layer and by the recomputation of activation checkpointing.

FlexAttention has no backward on CPU: the provider is offered on CUDA and ROCm only (ROCm: Triton's AMD backend,
not run here); on CPU the forward runs eagerly, which is what the contract tests use.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

_compiled = torch.compile(flex_attention, dynamic=False)
_cache = threading.local()  # the last block mask: (key, BlockMask)


def _key(documents: torch.Tensor | None, s: int, device: torch.device) -> tuple[Any, ...]:
    if documents is None:
        return (None, s, device)
    return (documents.data_ptr(), documents._version, tuple(documents.shape), documents.device)


def block_mask(documents: torch.Tensor | None, s: int, device: torch.device) -> BlockMask:
    """Causal within each document (``documents`` ``[b, s]``), or plain causal (``None``), as a block mask."""
    key = _key(documents, s, device)
    hit = getattr(_cache, "last", None)
    if hit is not None and hit[0] == key:
        return hit[1]
    gpu = device.type != "cpu"
    if documents is None:

        def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return kv <= q

        mask = create_block_mask(mask_mod, 1, None, s, s, device=device, _compile=gpu)
    else:
        docs = documents

        def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return (docs[b, q] == docs[b, kv]) & (kv <= q)

        mask = create_block_mask(mask_mod, docs.shape[0], None, s, s, device=device, _compile=gpu)
    _cache.last = (key, mask)
    return mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    if not causal:
        raise ValueError("the flex provider computes causal attention (within each document with documents=)")
    mask = block_mask(documents, q.shape[-2], q.device)
    kernel = flex_attention if q.device.type == "cpu" else _compiled
    return kernel(q, k, v, block_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
