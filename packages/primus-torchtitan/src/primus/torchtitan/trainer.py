"""torchtitan's Trainer, with its gradient scale made the same for every layout.

Two torchtitan 0.2.2 behaviours make the gradients (and so clipping, the grad norm and, through
clipping, the training) depend on the layout: pipelines backpropagate the summed token loss, and DDP
averages over replicas a loss already divided by the global token count. After the last micro-batch
of a step, before torchtitan clips, the gradients are rescaled to those of the mean token loss
(:func:`primus.torchtitan.compat.pp_grad_scale`, :func:`~primus.torchtitan.compat.ddp_grad_scale`).
Everything else is torchtitan's own training step and loop.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from primus.torchtitan import compat

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.train import Trainer  # noqa: E402


class PrimusTrainer(Trainer):
    def __init__(self, job_config: Any) -> None:
        super().__init__(job_config)
        self._microbatch = 0
        if job_config.training.mixed_precision_param == "float32":
            self.maybe_enable_amp = contextlib.nullcontext()  # fp32 needs no autocast (which would warn)

    def _grad_scale(self, global_valid_tokens: torch.Tensor) -> float:
        dims = self.parallel_dims
        if dims.pp_enabled:
            return compat.pp_grad_scale(float(global_valid_tokens))
        if dims.dp_replicate_enabled and not dims.fsdp_enabled:
            return compat.ddp_grad_scale(dims.dp_replicate)
        return 1.0

    def forward_backward_step(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        loss = super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )
        self._microbatch += 1
        if self._microbatch == self.gradient_accumulation_steps:  # the step's gradients are complete
            self._microbatch = 0
            compat.rescale_grads(self.model_parts, self._grad_scale(global_valid_tokens))
        return loss

    def train(self) -> None:
        self.metrics_processor.reset_clock()
        super().train()
