"""How evenly a mixture-of-experts model spreads its tokens over its experts, as two numbers a person reads.

An engine adapter names its routers (``Engine.expert_routers()``: ``(global layer index, router module, counts)``,
``counts(router output) -> tokens per expert [E]``); :class:`ExpertLoad` adds each router's counts up in a forward
hook over the logging interval, sums them over all ranks at each logging step (data-parallel ranks route different
tokens, pipeline stages hold different layers) and reports, per layer, each expert's share against the even share:

- ``moe_load_max``: the busiest expert's tokens / the mean expert's, the worst layer (1.0: perfectly even; a
  capacity factor drops tokens above it);
- ``moe_load_min``: the idlest expert's tokens / the mean expert's, the worst layer (0.0: an expert got no token);
- ``moe_dropped`` (with ``model.moe.capacity_factor``): the share of token-to-expert assignments the capacity dropped,
  all layers (each router's input tokens × top-k against what it routed);
- ``moe_aux_loss`` / ``moe_seq_aux_loss`` (defined here and in :mod:`primus.core.run.balancing`, measured by the engine
  whose routers compute the losses: ``Engine.interval_metrics()``).

A recomputed forward (activation checkpointing) or tensor-parallel ranks routing the same tokens count a layer's
tokens again for every expert alike: the ratios do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

METRICS = {
    "moe_dropped": "MoE with an expert capacity: the share of token-to-expert assignments dropped in the interval",
    "moe_load_max": "MoE: the busiest expert's tokens over the mean expert's, worst layer, in the interval (1 = even)",
    "moe_load_min": "MoE: the idlest expert's tokens over the mean expert's, worst layer, in the interval (0 = idle)",
    # measured by the engine (Engine.interval_metrics): its router computes the loss
    "moe_aux_loss": "MoE with aux-loss balancing: the load-balancing loss before its coefficient (Switch "
    "Transformer's E * sum_i f_i * P_i, 1 = even), mean over MoE layers and the interval's routed batches",
    "moe_seq_aux_loss": "MoE with model.moe.seq_aux_loss_coeff: DeepSeek-V3's sequence-wise balancing loss before its "
    "coefficient (the same formula over each sequence's tokens, averaged over sequences), mean over MoE layers and the "
    "interval's routed batches",
}

Router = tuple[int, torch.nn.Module, Callable[[Any], torch.Tensor]]


class ExpertLoad:
    def __init__(
        self,
        routers: list[Router],
        num_layers: int,
        num_experts: int,
        device: torch.device | str,
        top_k: int | None = None,
    ) -> None:
        """``top_k``: the experts each token is routed to, given when tokens can be dropped (``moe_dropped``)."""
        self.top_k = top_k
        # per layer: tokens routed to each expert, then the assignments asked for (input tokens × top-k)
        self.counts = torch.zeros(num_layers, num_experts + 1, dtype=torch.float32, device=device)
        self.handles = [
            module.register_forward_hook(functools.partial(self._count, layer, counts))
            for layer, module, counts in routers
        ]

    def _count(self, layer: int, counts: Callable[[Any], torch.Tensor], _module: Any, args: Any, output: Any) -> None:
        with torch.no_grad():
            self.counts[layer, :-1] += counts(output).to(self.counts)
            if self.top_k is not None:  # the router's input: [..., hidden], one row per token
                self.counts[layer, -1] += args[0].numel() // args[0].shape[-1] * self.top_k

    def metrics(self) -> dict[str, float]:
        """The interval's two numbers (the same on every rank: call on all ranks at the same steps); starts the next
        interval."""
        counts = self.counts.clone()
        self.counts.zero_()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        routed, asked = counts[:, :-1], counts[:, -1]
        seen = routed[routed.sum(1) > 0]  # MoE layers that routed tokens (dense layers stay zero)
        if seen.numel() == 0:
            return {}
        share = seen / seen.mean(1, keepdim=True)
        out = {"moe_load_max": float(share.max()), "moe_load_min": float(share.min())}
        if self.top_k is not None:
            out["moe_dropped"] = float(1 - routed.sum() / asked.sum())
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
