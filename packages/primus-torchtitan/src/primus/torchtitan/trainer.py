"""torchtitan's Trainer, driven one step at a time by core's training loop (:mod:`primus.torchtitan.engine`), with
its gradient scale made the same for every layout and core's health gate before each update.

Two torchtitan 0.2.2 behaviours make the gradients (and so clipping, the grad norm and, through
clipping, the training) depend on the layout: pipelines backpropagate the summed token loss, and DDP
averages over replicas a loss already divided by the global token count. After the last micro-batch
of a step, before torchtitan clips, the gradients are rescaled to those of the mean token loss
(:func:`primus.torchtitan.compat.pp_grad_scale`, :func:`~primus.torchtitan.compat.ddp_grad_scale`).

Health: once the step's grad norm is known (torchtitan's clip,
:func:`primus.torchtitan.compat.grad_norm_recorder`) and before the optimizer update, the step's global loss
and grad norm go to core's gate (``self.gate``); a refused update is dropped: gradients zeroed, the
optimizer does not step. The learning rate is core's (:mod:`primus.core.run.schedule`), set on every
optimizer before the step (:meth:`PrimusTrainer.set_lr`); torchtitan's LR schedulers do not step. Norms and
biases take no weight decay (:func:`exempt_from_weight_decay`), as in Megatron-Core.

Everything else is torchtitan's own training step.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from primus.core.kernels.documents import document_ids
from primus.core.run.metrics import global_token_loss
from primus.core.run.optimizer import split_weight_decay
from primus.torchtitan import compat
from primus.torchtitan.loss import head_targets

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402
from torchtitan.train import Trainer  # noqa: E402


def exempt_from_weight_decay(optimizers: Any) -> None:
    """Core's weight-decay rule (:func:`primus.core.run.optimizer.takes_weight_decay`: norm weights and biases take
    none) on each of torchtitan's optimizers: its one param group split in two, before any state exists."""
    for optimizer in optimizers:
        optimizer.param_groups = split_weight_decay(optimizer.param_groups)


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP2 module of ``model`` back to its sharded parameters after a forward-only pass.

    FSDP2 modules built with ``reshard_after_forward=False`` (torchtitan's norm + output group, the root, every
    block under PP) stay unsharded after their forward until the backward reshards them. A forward without a
    backward (an evaluation) would leave the unsharded tensors registered as the module's parameters, not the
    sharded DTensors the optimizer holds, and the next checkpoint's optimizer state dict could not name them
    (``KeyError`` in DCP's ``_get_optim_state_dict``)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class PrimusTrainer(Trainer):
    def __init__(self, job_config: Any) -> None:
        super().__init__(job_config)
        self._microbatch = 0
        if job_config.training.mixed_precision_param == "float32":
            self.maybe_enable_amp = contextlib.nullcontext()  # fp32 needs no autocast (which would warn)
        self._step_losses: list[torch.Tensor] = []
        self.gate: Any = None  # core's health gate of the running step: gate(loss, grad_norm) -> apply?
        self.last_loss, self.last_grad_norm, self.skipped = math.nan, None, False
        self.document_eos: int | None = None  # data.document_mask: the EOS id that ends a document (the engine sets it)
        self.balancing: Any = None  # auxiliary-loss balancing (primus.torchtitan.balancing; the engine sets it)
        exempt_from_weight_decay(self.optimizers)
        # a step the health gate refuses: the optimizer does not step; core's loop owns the learning rate
        optimizer_step = self.optimizers.step
        self.optimizers.step = lambda *a, **k: self._unless_skipped(optimizer_step, *a, **k)
        self.lr_schedulers.step = lambda *a, **k: None

    def set_lr(self, lr: float) -> None:
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def _unless_skipped(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.skipped:
            self.optimizers.zero_grad()
            return None
        return fn(*args, **kwargs)

    def _global_loss(self) -> float:
        """The step's mean token loss over the world: core's :func:`global_token_loss`, as megatron's (NaN if any
        rank's is).

        Each rank's recorded losses sum to its token-loss sum / global tokens; the ranks of one TP group hold the
        same value, and pipeline stages other than the last hold none. Each rank that holds one adds
        ``[its value, tp · pp / world]``: over the world, ``[tp · loss, tp]``."""
        dims = self.parallel_dims
        has_loss = not dims.pp_enabled or self.pp_has_last_stage
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        if has_loss and self._step_losses:
            local = torch.stack(self._step_losses).sum()
            if isinstance(local, DTensor):  # the loss under loss parallelism (replicated over the TP group)
                local = local.full_tensor()
            sums[0] = local.double()
            sums[1] = dims.tp * dims.pp / dims.world_size
        return global_token_loss(sums)

    def _check_health(self, grad_norm: torch.Tensor) -> None:
        """Called with the step's grad norm, before the optimizer update (the gate raises to stop the run)."""
        self.last_loss, self.last_grad_norm = self._global_loss(), float(grad_norm)
        self.skipped = not self.gate(self.last_loss, self.last_grad_norm)

    def _grad_scale(self, global_valid_tokens: torch.Tensor) -> float:
        dims = self.parallel_dims
        if dims.pp_enabled:
            return compat.pp_grad_scale(float(global_valid_tokens))
        if dims.dp_replicate_enabled and not dims.fsdp_enabled:
            return compat.ddp_grad_scale(dims.dp_replicate)
        return 1.0

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        """torchtitan's, plus (``data.document_mask``) each position's document as the model's ``attention_masks``:
        a plain ``[b, s]`` tensor, which the pipeline schedules split by micro-batch and hand to every stage, and
        which the document-masking attention modules (:func:`primus.torchtitan.kernels.swap_modules`) read. Packed
        fine-tuning chats bring their documents with the batch (``"documents"``), not recomputed from EOS."""
        input_dict = dict(input_dict)
        documents = input_dict.pop("documents", None)
        inputs, labels, extra_inputs, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        if documents is not None:
            extra_kwargs["attention_masks"] = documents
        elif self.document_eos is not None:
            extra_kwargs["attention_masks"] = document_ids(inputs, self.document_eos)
        return inputs, labels, extra_inputs, extra_kwargs

    def forward_backward_step(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        if self.balancing is not None:  # the routers' losses: their gradient scale in this layout, for this step
            dims = self.parallel_dims
            pp = compat.pp_grad_scale(float(global_valid_tokens)) if dims.pp_enabled else 1.0
            self.balancing.set_layout(dims.tp, pp)
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

    @torch.no_grad()
    def evaluate(self, batches: Any) -> float:
        """Forward only over ``batches`` (``(input_dict, labels)`` pairs of this rank), as torchtitan's Validator
        runs it (the pipeline schedule's ``eval``, else the model and loss function): the mean token loss over the
        world's tokens, the same on every rank. No gradient is made; the optimizer and training data are untouched;
        FSDP2 modules are resharded after (:func:`reshard`).
        """
        dims = self.parallel_dims
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for part in self.model_parts:
            part.eval()
        try:
            for input_dict, labels in batches:
                input_dict = {k: v.to(self.device) for k, v in input_dict.items()}
                inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(
                    input_dict, labels.to(self.device)
                )
                if dims.pp_enabled:
                    targets, losses = (labels, []) if self.pp_has_last_stage else (None, None)
                    with self.train_context():
                        if self.pp_has_first_stage:
                            self.pp_schedule.eval(inputs, **extra_inputs, **extra_kwargs, target=targets, losses=losses)
                        else:
                            self.pp_schedule.eval(**extra_kwargs, target=targets, losses=losses)
                    loss_sum = torch.stack(losses).sum() if self.pp_has_last_stage else None
                else:
                    with head_targets(self.model_parts, labels), self.train_context(), self.maybe_enable_amp:
                        loss_sum = self.loss_fn(self.model_parts[0](inputs, **extra_inputs, **extra_kwargs), labels)
                if loss_sum is not None:  # ranks of one TP group add the same pair: the ratio is unchanged
                    if isinstance(loss_sum, DTensor):
                        loss_sum = loss_sum.full_tensor()
                    sums[0] += loss_sum.detach().double().to(self.device).reshape(-1)[0]
                    sums[1] += (labels != IGNORE_INDEX).sum()
        finally:
            for part in self.model_parts:
                part.train()
                reshard(part)
            if self.balancing is not None and dims.pp_enabled:  # the schedule infers its shapes again
                self.balancing.shape_inference()
        return global_token_loss(sums)

    def train_step(self, data_iterator: Any) -> None:
        self._step_losses.clear()
        self.skipped = False
        with compat.grad_norm_recorder(self._check_health):
            super().train_step(data_iterator)
