"""Megatron's routed experts as grouped GEMMs: :class:`GroupedExperts`.

megatron-core 0.16 runs a layer's local experts either as ``SequentialMLP`` (a loop of small MLPs: three GEMM
launches per expert, 384 per layer at 128 experts, which set the step time on the H200) or as ``GroupedMLP`` /
``TEGroupedMLP``, which need the ``grouped_gemm`` package or Transformer Engine and hold the experts' weights in
another layout (megatron's own docstring: their optimizer state does not load into SequentialMLP's).

:class:`GroupedExperts` is SequentialMLP with its forward replaced: the same parameters (each expert's
``linear_fc1`` / ``linear_fc2``), so the same sharded state dict, checkpoints, resume across layouts and Hugging Face
mapping; the forward stacks the local experts' weights and runs the ``grouped_gemm`` provider twice with the
``swiglu`` provider once between them, for all experts at once. Autograd takes the stacked weights' gradients
back to each expert's parameter (``torch.stack``'s backward is a view per expert). The stacked copy of the local
experts' weights is saved for the backward (under full recompute, only while a layer recomputes): one more copy of
each local expert weight in the compute dtype, the price of keeping SequentialMLP's parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from primus.core.protocols import load_ref


class GroupedExperts(SequentialMLP):
    def __init__(self, num_local_experts: int, config: Any, submodules: Any, pg_collection: Any = None, *,
                 gemm: Any = "", swiglu: Any = ""):  # fmt: skip
        super().__init__(num_local_experts, config, submodules, pg_collection)
        self.gemm = load_ref(gemm)
        self.swiglu = load_ref(swiglu)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:  # fmt: skip
        if self.config.moe_apply_probs_on_input or permuted_local_hidden_states.shape[0] == 0:
            # probabilities on the input, or no token routed to this rank's experts (expert parallelism): megatron's
            # loop (an empty grouped GEMM is not every kernel's case), which still gives each weight a gradient
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        # the dispatcher may hold the counts on the host (SequentialMLP reads them with .tolist())
        offs = torch.as_tensor(tokens_per_expert, device=x.device).cumsum(0, dtype=torch.int32)
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, 2·ffn/tp, h]: gate rows, up rows
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, h, ffn/tp]
        gate, up = self.gemm(x, fc1, offs).chunk(2, dim=-1)
        # megatron's MLP: the routing probability scales the activation, in the activation's dtype
        act = (self.swiglu(gate, up) * permuted_probs.unsqueeze(-1)).to(x.dtype)
        return self.gemm(act, fc2, offs), None
