"""Plain-PyTorch kernels: correct everywhere (CPU included), the reference other providers are
checked against, and core's defaults when no faster provider is installed.

Attention uses ``scaled_dot_product_attention``, which dispatches to cuDNN / flash / memory-efficient
kernels on GPUs, so the default is usable at long sequences (megatron-core's unfused local attention
is not). The rest are the textbook formulas.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from primus.core.protocols import Availability


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    # q [b, h, s, d]; k, v [b, h_kv, s, d]: enable_gqa broadcasts kv heads without a copy where the
    # backend supports it (flash / cuDNN on CUDA, math on CPU).
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), ignore_index=ignore_index)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [b, s, h, d]; cos, sin [s, d]; rotate-half (GPT-NeoX / HF / Megatron non-interleaved) layout.
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def always(device: str, **_: object) -> Availability:
    return Availability(True)
