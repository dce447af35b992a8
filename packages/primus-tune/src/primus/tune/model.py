"""A plain decoder built from core's ``ModelConfig``, for recording GEMM shapes (``primus tune gemm record``).

The GEMMs of a dense decoder step are fixed by the config, the token count and the engine's layout of its
linears, so this model reproduces them without an engine: per layer q/k/v, o, gate/up, down, then the output
head (the embedding matrix when tied). ``fused=True`` is Megatron's layout (one qkv GEMM, one gate+up GEMM),
``False`` TorchTitan's (separate). Tensor parallelism splits the column-parallel outputs (qkv, gate/up, head)
and the row-parallel inputs (o, down) by ``tp``. Attention runs outside the recorder: on GPUs it is its own
kernel (flash / cuDNN / AITER), not a BLAS GEMM. Norms and RoPE change no GEMM shape; RoPE is left out.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from primus.core.config.schema import ModelConfig


class _UnrecordedAttention(torch.autograd.Function):
    """SDPA with the recorder paused in forward and backward (on ``meta`` and CPU SDPA's math path would
    otherwise show up as ``bmm``s that the GPU kernels never issue)."""

    @staticmethod
    def forward(ctx, q, k, v, unrecorded):
        ctx.unrecorded = unrecorded
        with torch.enable_grad(), unrecorded():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        ctx.graph = (inputs, out)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        inputs, out = ctx.graph
        with ctx.unrecorded():
            return (*torch.autograd.grad(out, inputs, grad), None)


class Block(nn.Module):
    def __init__(self, m: ModelConfig, tp: int, fused: bool) -> None:
        super().__init__()
        hd = m.kv_channels
        self.heads, self.kv_heads, self.hd = m.num_attention_heads // tp, m.num_kv_heads // tp, hd
        q, kv, ffn, d = self.heads * hd, self.kv_heads * hd, m.ffn_hidden_size // tp, m.hidden_size
        self.fused = fused
        if fused:
            self.qkv = nn.Linear(d, q + 2 * kv, bias=m.qkv_bias)
            self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        else:
            self.wq, self.wk, self.wv = (nn.Linear(d, n, bias=m.qkv_bias) for n in (q, kv, kv))
            self.w1, self.w3 = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.wo = nn.Linear(q, d, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(d, eps=m.norm_eps), nn.RMSNorm(d, eps=m.norm_eps)

    def forward(self, x: torch.Tensor, unrecorded: Any) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        if self.fused:
            q, k, v = self.qkv(h).split([self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], -1)
        else:
            q, k, v = self.wq(h), self.wk(h), self.wv(h)
        q = q.view(b, s, self.heads, self.hd).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        a = _UnrecordedAttention.apply(q, k, v, unrecorded)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        gate, up = self.gate_up(h).chunk(2, -1) if self.fused else (self.w1(h), self.w3(h))
        return x + self.w2(F.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self, m: ModelConfig, tp: int = 1, fused: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(m.vocab_size // tp if tp > 1 else m.vocab_size, m.hidden_size)
        self.layers = nn.ModuleList(Block(m, tp, fused) for _ in range(m.num_layers))
        self.norm = nn.RMSNorm(m.hidden_size, eps=m.norm_eps)
        self.head = None if m.tie_word_embeddings else nn.Linear(m.hidden_size, self.embed.num_embeddings, bias=False)

    def forward(self, tokens: torch.Tensor, unrecorded: Any = contextlib.nullcontext) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, unrecorded)
        x = self.norm(x)
        return F.linear(x, self.embed.weight) if self.head is None else self.head(x)


def step_gemms(
    m: ModelConfig,
    *,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "meta",
    tp: int = 1,
    cp: int = 1,
    fused: bool = False,
):
    """Run one forward + backward of :class:`Decoder` under a :class:`GemmRecorder`; return the recorder.

    ``device="meta"`` computes nothing (shapes and strides only), so a 70B model records in seconds on a laptop.
    Tokens per rank are ``micro_batch × seq_len / cp`` (context parallelism splits the sequence)."""
    from primus.tune.record import GemmRecorder

    with torch.device(device):
        model = Decoder(m, tp=tp, fused=fused).to(dtype)
        tokens = torch.randint(0, model.embed.num_embeddings, (micro_batch, seq_len // cp))
    with GemmRecorder() as rec:
        logits = model(tokens, unrecorded=rec.paused)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
    return rec
