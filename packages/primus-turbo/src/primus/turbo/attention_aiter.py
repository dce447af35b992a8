"""Attention through AITER, AMD's kernel library for ROCm (CK and hand-written asm "v3" kernels).

Written against AITER's public entry point (``aiter/ops/mha.py``, tag v0.1.14.post1)::

    aiter.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, ...)

with q ``(b, s, h, d)`` and k/v ``(b, s, h_kv, d)`` (GQA when ``h % h_kv == 0``), causal mask aligned
bottom-right (the same as top-left here: Primus always passes ``s_q == s_k``), default scale
``d ** -0.5``. Primus's contract is ``[b, h, s, d]``, so inputs and the output are transposed (views;
the last dim stays contiguous, which is what the kernels need).

Not run on this project's machines: it needs an AMD GPU with a ROCm build of torch and AITER
installed. The CPU tests check its availability rules and the layout handling against a stand-in
``aiter`` module that computes the documented semantics with torch.
"""

from __future__ import annotations

import torch


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    import aiter

    out = aiter.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0, softmax_scale=scale, causal=causal
    )
    return out.transpose(1, 2)  # (b, s, h, d) -> [b, h, s, d]
