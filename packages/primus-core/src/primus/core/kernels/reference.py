"""Plain-PyTorch kernels: correct everywhere (CPU included), the reference other providers are
checked against, and core's defaults when no faster provider is installed.

Attention uses ``scaled_dot_product_attention``, which dispatches to cuDNN / flash / memory-efficient
kernels on GPUs, so the default is usable at long sequences (megatron-core's unfused local attention
is not). The rest are the textbook formulas.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from primus.core.contracts.protocols import Availability
from primus.core.kernels.documents import document_causal_mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    # q [b, h, s, d]; k, v [b, h_kv, s, d]: enable_gqa broadcasts kv heads without a copy where the
    # backend supports it (flash / cuDNN on CUDA, math on CPU). documents [b, s] (data.document_mask): a boolean
    # mask, causal within each document (the memory-efficient kernel on GPUs; flash and cuDNN take no mask).
    gqa = k.shape[1] != q.shape[1]
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    if not causal:
        raise ValueError("document masking is causal within each document")
    mask = document_causal_mask(documents)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's own op: one fused kernel on GPUs, fp32 accumulation. The textbook formula spelled out in
    # Python (x · rsqrt(mean(x²) + eps) · w) launched ~7 kernels and cost 0.85 vs 0.125 ms fwd+bwd at
    # [4096, 2, 2048] bf16 on the H200, 10% of a Llama 3.2 1B Megatron step.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), ignore_index=ignore_index)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [b, s, h, d]; cos, sin [s, d]; rotate-half (GPT-NeoX / HF / Megatron non-interleaved) layout.
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # The per-expert loop every grouped GEMM is checked against: rows offs[g-1]:offs[g] of x times w[g]ᵀ, rows past
    # offs[-1] zero. One host sync (offs to Python) and one matmul per group.
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    parts = [x[a:b] @ w[g].transpose(0, 1) for g, (a, b) in enumerate(zip(starts, ends, strict=True))]
    dtype = parts[0].dtype if parts else x.dtype  # under autocast the matmuls' dtype
    parts.append(torch.zeros(x.shape[0] - (ends[-1] if ends else 0), w.shape[1], dtype=dtype, device=x.device))
    return torch.cat(parts)


def moe_permute(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    # indexing: autograd's backward of x[rows] scatter-adds each token's k copies back (index_put with accumulate)
    return x[order // k]


def _unpermute(routed: torch.Tensor, order: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    # TorchTitan's own combine: the rows back in slot order, then each token's k rows weighted in fp32 (a batched
    # [1, k] x [k, d] product)
    tokens, k = probs.shape
    slots = routed.new_zeros(tokens * k, routed.shape[1]).index_copy(0, order, routed)
    out = torch.bmm(probs.float().unsqueeze(1), slots.view(tokens, k, -1).float())
    return out.squeeze(1).to(routed.dtype)


moe_permute.unpermute = _unpermute


def moe_router(
    logits: torch.Tensor,
    k: int,
    *,
    score: str = "softmax",
    bias: torch.Tensor | None = None,
    normalize: bool = False,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    # TorchTitan's TokenChoiceTopKRouter after its gate (fp32 scores; the bias chooses, the scores weigh)
    scores = torch.sigmoid(logits.float()) if score == "sigmoid" else F.softmax(logits.float(), dim=-1)
    indices = torch.topk(scores if bias is None else scores + bias, k=k, dim=-1).indices
    probs = scores.gather(-1, indices)
    if normalize:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    return probs * scale, indices


def always(device: str, **_: object) -> Availability:
    return Availability(True)
