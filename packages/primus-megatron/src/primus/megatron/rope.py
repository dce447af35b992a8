"""RoPE through a Primus ``rope`` provider in megatron's SelfAttention.

megatron applies RoPE inside ``SelfAttention.forward`` (``apply_rotary_pos_emb``, a module-level
function, not a spec slot) between the q/k projection (+ q/k norms) and core attention. The override
point is the method that produces q/k: :class:`KernelRoPESelfAttention` runs megatron's forward without
its RoPE and rotates q and k at the end of ``get_query_key_value_tensors`` with the provider (same
rotate-half math; the position table in fp32 where megatron rounds it to the activation dtype).

Only for megatron's plain layout: rotate-half (not interleaved), the whole head rotated, no packed
sequences, no inference cache, no yarn/MLA scaling; anything else keeps megatron's own path.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.attention import SelfAttention

from primus.core.contracts.protocols import KernelProvider, load_ref
from primus.core.kernels import reference


def rope_impl(kernels: dict[str, KernelProvider]) -> tuple[Any, str]:
    """The ``rope`` provider's impl for the layer spec (None: megatron's own RoPE), and why."""
    prov = kernels.get("rope")
    if prov is None:
        return None, "no rope provider selected: megatron's apply_rotary_pos_emb"
    if prov.load() is reference.rope:
        return None, "core's reference: megatron's apply_rotary_pos_emb computes the same"
    return prov.impl, f"{prov.name} provider"


class KernelRoPESelfAttention(SelfAttention):
    """megatron's SelfAttention with q/k rotated by a Primus ``rope`` provider."""

    def __init__(self, *args: Any, rope: Any = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rope = load_ref(rope)
        c = self.config
        # megatron layouts the provider contract (rotate-half over the whole head, fp32 angles) does not cover
        self.rope_supported = not (
            c.rotary_interleaved
            or c.multi_latent_attention
            or c.apply_rope_fusion
            or getattr(c, "fused_single_qkv_rope", False)
            or c.no_rope_freq
            or hasattr(c, "yarn_rotary_scaling_factor")
        )
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, **kwargs: Any):
        freqs = kwargs.get("rotary_pos_emb")
        plain = (
            self.rope_supported
            and isinstance(freqs, torch.Tensor)
            and freqs.shape[-1] == self.hidden_size_per_attention_head
            and kwargs.get("packed_seq_params") is None
            and kwargs.get("inference_context") is None
            and kwargs.get("inference_params") is None
        )
        if not plain:
            return super().forward(hidden_states, attention_mask, **kwargs)
        self._cos_sin = self._tables(freqs)
        try:
            return super().forward(hidden_states, attention_mask, **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._cos_sin = None

    # (freqs, cos, sin) of the last rotary table: GPTModel hands every layer the same tensor each forward,
    # so the fp32 cos/sin are made once per forward, not once per layer; holding freqs keeps `is` sound
    _cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def _tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cached = KernelRoPESelfAttention._cached
        if cached is None or cached[0] is not freqs:
            angles = freqs.reshape(freqs.shape[0], freqs.shape[-1]).float()  # [s, 1, 1, d] -> [s, d]
            cached = KernelRoPESelfAttention._cached = (freqs, angles.cos(), angles.sin())
        return cached[1:]

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if self._cos_sin is None:
            return out
        query, key, *rest = out
        return (self._rotate(query), self._rotate(key), *rest)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        # megatron's [s, b, h, d] as the contract's [b, s, h, d] (a view), and the result back
        cos, sin = self._cos_sin
        return self.rope(x.transpose(0, 1), cos, sin).transpose(0, 1)
