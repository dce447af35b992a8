"""torchtitan's Trainer, with its gradient scale made the same for every layout, Primus's health checks
and Primus's step profiler.

Two torchtitan 0.2.2 behaviours make the gradients (and so clipping, the grad norm and, through
clipping, the training) depend on the layout: pipelines backpropagate the summed token loss, and DDP
averages over replicas a loss already divided by the global token count. After the last micro-batch
of a step, before torchtitan clips, the gradients are rescaled to those of the mean token loss
(:func:`primus.torchtitan.compat.pp_grad_scale`, :func:`~primus.torchtitan.compat.ddp_grad_scale`).

Health (``train.health``, :class:`primus.core.health.HealthMonitor`): once the step's grad norm is known
(torchtitan's clip, :func:`primus.torchtitan.compat.grad_norm_recorder`) and before the optimizer
update, the step's global loss and grad norm are checked. A non-finite one stops the run
(:class:`~primus.core.health.NonFiniteError`, nothing of that step is applied or saved) or, with
``on_nonfinite: skip``, drops the update: gradients zeroed, neither the optimizer nor the LR schedule
steps (the schedule counts applied updates, as Megatron's does), while the step counter and the data
move on (step ``n`` always consumed global batch ``n``; checkpoints keep their step names).

Profiling (``profile``, :class:`primus.core.profile.capture.StepProfiler`): entered around the training
loop, stepped after each training step; traces land in ``<output_dir>/traces/rank<r>.json``.

Everything else is torchtitan's own training step and loop.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from primus.core.health import HealthMonitor
from primus.torchtitan import compat
from primus.torchtitan.loss import head_targets

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.train import Trainer  # noqa: E402


class PrimusTrainer(Trainer):
    def __init__(
        self,
        job_config: Any,
        *,
        health: HealthMonitor | None = None,
        profiler: Any = None,
        on_step: Any = None,
        checkpoint_manager: Any = None,
    ) -> None:
        # checkpoint_manager builds torchtitan's checkpointer (Primus's atomic one, primus.torchtitan.checkpoint)
        with compat.checkpoint_manager_class(checkpoint_manager) if checkpoint_manager else contextlib.nullcontext():
            super().__init__(job_config)
        self.on_step = on_step  # called with the step number after each training step (plugins' per-step hook)
        self._microbatch = 0
        if job_config.training.mixed_precision_param == "float32":
            self.maybe_enable_amp = contextlib.nullcontext()  # fp32 needs no autocast (which would warn)
        self.health = health
        self.profiler = profiler if profiler is not None else contextlib.nullcontext()
        self.metrics_processor.health = health
        self._step_losses: list[torch.Tensor] = []
        self._skip_update = False
        # the update of a step the health check skips: neither the optimizer nor the LR schedule steps
        optimizer_step, lr_step = self.optimizers.step, self.lr_schedulers.step
        self.optimizers.step = lambda *a, **k: self._unless_skipped(optimizer_step, *a, **k)
        self.lr_schedulers.step = lambda *a, **k: self._unless_skipped(lr_step, *a, **k)

    def _unless_skipped(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._skip_update:
            self.optimizers.zero_grad()
            return None
        return fn(*args, **kwargs)

    def _global_loss(self) -> float:
        """The step's mean token loss over the world, NaN if any rank's is not finite (one small all-reduce).

        Each rank's recorded losses sum to its token-loss sum / global tokens; ranks of one TP group hold
        the same value, and pipeline stages other than the last hold none."""
        dims = self.parallel_dims
        has_loss = not dims.pp_enabled or self.pp_has_last_stage
        local = torch.stack(self._step_losses).sum().float() if has_loss and self._step_losses else None
        if isinstance(local, DTensor):  # the loss under loss parallelism (replicated over the TP group)
            local = local.full_tensor()
        if dims.world_size == 1:
            return float(local) if local is not None else math.nan
        pair = torch.zeros(2, device=self.device)
        if local is not None:
            finite = torch.isfinite(local)
            pair[0] = torch.where(finite, local, torch.zeros_like(local))
            pair[1] = (~finite).float()
        torch.distributed.all_reduce(pair)
        loss, bad = pair.tolist()
        return math.nan if bad > 0 else loss / dims.tp

    def _check_health(self, grad_norm: torch.Tensor) -> None:
        """Called with the step's grad norm, before the optimizer update (stop raises, skip gates it)."""
        self._skip_update = False
        if self.health is not None:
            verdict = self.health.check(self.step, self._global_loss(), float(grad_norm))
            self._skip_update = verdict == "skip"

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
        with head_targets(self.model_parts, labels):  # a fused output layer computes the loss in its forward
            loss = super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        self._step_losses.append(loss.detach().reshape(-1)[0])
        self._microbatch += 1
        if self._microbatch == self.gradient_accumulation_steps:  # the step's gradients are complete
            self._microbatch = 0
            compat.rescale_grads(self.model_parts, self._grad_scale(global_valid_tokens))
        return loss

    def train_step(self, data_iterator: Any) -> None:
        self._step_losses.clear()
        with compat.grad_norm_recorder(self._check_health):
            super().train_step(data_iterator)
        self._skip_update = False
        self.profiler.step()
        if self.on_step is not None:
            self.on_step(self.step)

    def train(self) -> None:
        self.metrics_processor.reset_clock()
        with self.profiler:
            super().train()
