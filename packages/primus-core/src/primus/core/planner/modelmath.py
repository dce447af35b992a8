"""Parameter count and training FLOPs per token of a dense decoder (Llama / Qwen / Mistral shape).

Parameters (d = hidden, h = heads, k = kv heads, c = head dim, f = ffn, V = vocab, L = layers):
  per layer = d·h·c (q) + 2·d·k·c (k, v) + h·c·d (o) + [qkv bias: h·c + 2·k·c] + [o bias: d] + [qk-norm: 2·c]
              + [attention sinks: h] + 3·d·f (SwiGLU gate, up, down) + 2·d (two RMSNorms)
  total     = V·d (embedding) + L·per layer + d (final norm) + [untied: V·d (output head)]

Training FLOPs per token (forward + backward = 3 × forward; a matmul of n weights costs 2n):
  6 · N_matmul + 12 · L · h·c · S
where N_matmul = total − V·d (the input embedding is a lookup) + [tied: V·d] (the head GEMM runs
either way; norm weights are counted too, as the usual 6·N does, < 0.01%), and 12·L·h·c·S counts QKᵀ and AV over a sequence of S tokens (no causal
discount, as PaLM/TorchTitan/Megatron count it; a sliding layer's queries attend to min(S, window) keys instead of
S). MFU = achieved FLOP/s ÷ peak FLOP/s.

Mixture of experts (``model.moe``, E experts of width e, top-k, S shared): an MoE layer's MLP is E·3·d·e + S·3·d·e
+ d·E (the router) instead of 3·d·f; a token runs k·3·d·e + S·3·d·e + d·E of it, so the *active* parameters (what
the FLOPs and MFU count) are the total less the (E − k) unused experts of every MoE layer. GPT-OSS's biases count too:
the router's (E) and each expert's (2·e + d, ``model.moe.expert_bias``).

Multi-token prediction (``model.mtp``, D depths): each depth is one more block (MoE where layer L + k would be) plus
its two input norms, ``eh_proj`` (2·d·d) and its output norm, counted in the total and the active parameters; its
logits run the shared output head again (V·d more GEMM weights a depth) and its attention over the sequence.

LoRA (``train.lora``, frozen base weights, adapters of A rank·(in + out) parameters in all): 4 · N_matmul + 6 · A +
the same attention term: a frozen weight's GEMM has no weight gradient, but the input gradient still runs through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from primus.core.config.deepseek import attention_flops_per_token, attention_params
from primus.core.config.schema import LoRAConfig, ModelConfig


@dataclass(frozen=True)
class ParamCount:
    embedding: int
    per_layer: int  # a dense layer (attention + norms + the dense SwiGLU MLP)
    layers: int  # every layer, dense and MoE
    final_norm: int
    output_head: int  # 0 when tied
    norms: int  # all RMSNorm weights (per-layer, qk-norm and final)
    moe_layers: int = 0  # how many layers have routed experts
    moe_layer: int = 0  # one MoE layer (attention + norms + router + all experts)
    moe_layer_active: int = 0  # of it, what one token runs (attention + norms + router + its top-k and shared experts)
    mtp: int = 0  # multi-token prediction's depths, all of them (their blocks, norms and eh_proj)
    mtp_active: int = 0  # of them, what one token runs
    mtp_moe_blocks: int = 0  # of the depths, those whose block is an MoE layer

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_norm + self.output_head + self.mtp

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding

    @property
    def active(self) -> int:
        """Parameters one token runs through (the total for a dense model)."""
        return self.total - self.moe_layers * (self.moe_layer - self.moe_layer_active) - (self.mtp - self.mtp_active)


def count_params(m: ModelConfig) -> ParamCount:
    d, h, k, c, f = m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.kv_channels, m.ffn_hidden_size
    attn = d * h * c + 2 * d * k * c + h * c * d
    if m.qkv_bias:
        attn += h * c + 2 * k * c
    attn += (d if m.attention_out_bias else 0) + (h if m.attention_sinks else 0)
    layer_norms = 2 * d + (2 * c if m.qk_norm else 0)
    if m.mla is not None:  # multi-head latent attention: primus.core.config.deepseek
        attn, mla_norms = attention_params(m)
        attn, layer_norms = attn - mla_norms, layer_norms + mla_norms
    per_layer = attn + 3 * d * f + layer_norms
    emb = m.vocab_size * d
    moe_n = moe_layer = moe_active = 0
    if m.moe is not None:
        e = m.moe
        moe_n = e.num_moe_layers(m.num_layers)
        expert, always = expert_params(m), attn + layer_norms + d * e.num_experts  # + router
        always += e.shared_experts * expert + (e.num_experts if m.family == "deepseek" or e.router_bias else 0)  # bias
        moe_layer, moe_active = always + e.num_experts * expert, always + e.experts_per_token * expert
    mtp = mtp_active = mtp_moe = 0
    for k in range(m.mtp.layers if m.mtp is not None else 0):
        own = 2 * d * d + 3 * d  # eh_proj, enorm, hnorm, the norm before the head
        moe = m.moe is not None and m.moe.is_moe_layer(m.num_layers + k)
        mtp += own + (moe_layer if moe else per_layer)
        mtp_active += own + (moe_active if moe else per_layer)
        mtp_moe += moe
    return ParamCount(
        embedding=emb,
        per_layer=per_layer,
        layers=(m.num_layers - moe_n) * per_layer + moe_n * moe_layer,
        final_norm=d,
        output_head=0 if m.tie_word_embeddings else emb,
        norms=m.num_layers * layer_norms + d,
        moe_layers=moe_n,
        moe_layer=moe_layer,
        moe_layer_active=moe_active,
        mtp=mtp,
        mtp_active=mtp_active,
        mtp_moe_blocks=mtp_moe,
    )


def expert_params(m: ModelConfig) -> int:
    """One routed (or shared) expert's parameters: its SwiGLU's gate, up and down, and their biases where
    ``model.moe.expert_bias`` (GPT-OSS); 0 for a dense model."""
    e = m.moe
    if e is None:
        return 0
    width = e.expert_ffn_hidden_size
    return 3 * m.hidden_size * width + (2 * width + m.hidden_size if e.expert_bias else 0)


def attended_keys(m: ModelConfig, seq_len: int) -> float:
    """Keys a query attends to, averaged over the layers (no causal discount): ``seq_len``, or at most the window in
    a sliding layer (``model.sliding_window``)."""
    if m.sliding_window is None:
        return float(seq_len)
    sliding = sum(m.is_sliding_layer(i) for i in range(m.num_layers))
    return ((m.num_layers - sliding) * seq_len + sliding * min(seq_len, m.sliding_window)) / m.num_layers


def matmul_params(m: ModelConfig) -> int:
    """Weights that take part in a GEMM per token (the output head counted even when tied; of the experts, those a
    token is routed to)."""
    p = count_params(m)
    heads = 1 + (m.mtp.layers if m.mtp is not None else 0)  # the output head's GEMM, once more a prediction depth
    return p.active - p.embedding - p.output_head + heads * p.embedding


def flops_per_token(m: ModelConfig, seq_len: int, lora: LoRAConfig | None = None) -> float:
    """Training (fwd + bwd) FLOPs per token; see the module docstring for the formula. With ``lora`` (``train.lora``)
    the base weights are frozen: their GEMMs run forward and the input gradient only (4 · N_matmul, no weight
    gradient), the adapters all three (6 · their parameters); attention's backward runs whole either way."""
    blocks = m.num_layers + (m.mtp.layers if m.mtp is not None else 0)  # multi-token prediction's attend too
    if m.mla is not None:
        attention = attention_flops_per_token(m, seq_len) * blocks / m.num_layers
    else:
        attention = 12.0 * blocks * m.num_attention_heads * m.kv_channels * attended_keys(m, seq_len)
    if lora is None:
        return 6.0 * matmul_params(m) + attention
    return 4.0 * matmul_params(m) + 6.0 * lora_params(m, lora) + attention


def lora_params(m: ModelConfig, lora: LoRAConfig) -> int:
    """The adapters' parameters (``train.lora``): ``rank · (in + out)`` for each adapted projection of every layer
    (:func:`primus.core.hf.lora.adapters`)."""
    from primus.core.hf.lora import adapters

    return sum(lora.rank * (a.in_features + a.out_features) for a in adapters(m, lora))


def human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))
