"""Attention through torch SDPA with the backend forced: cuDNN or flash, never a silent fallback.

Core's ``sdpa`` provider lets torch pick a backend per call. Forcing one makes the choice visible in
the run log and the config ("attention: cudnn"), and a call that the backend cannot serve raises
instead of quietly running the slower math kernel. Same call contract as
:mod:`primus.core.kernels.selection`: q ``[b, h, s, d]``, k/v ``[b, h_kv, s, d]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _sdpa(
    backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
) -> torch.Tensor:
    # set_priority=True: the listed backend is tried first (here: the only one allowed).
    with sdpa_kernel([backend], set_priority=True):
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )


def cudnn_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    return _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal, scale)


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    return _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal, scale)
