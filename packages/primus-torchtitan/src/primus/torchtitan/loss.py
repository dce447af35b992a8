"""torchtitan's output projection and loss as one fused call (the provider's ``linear_cross_entropy``).

torchtitan computes ``logits = model.output(h)`` in the model's forward and ``loss_fn(logits, labels)`` after
it, materialising ``[tokens, vocab]`` logits (and an fp32 copy in the loss). Here the output ``nn.Linear`` is
retyped to :class:`FusedOutput` (same module, same ``weight``, same state-dict keys, tied or not): while the
trainer holds the micro-batch's labels on it (:func:`head_targets`), its forward returns the token-loss
*sum* (torchtitan's loss contract) computed from ``h`` and its weight by the fused kernel, and the loss
function (:func:`head_loss`) passes that sum through.

The loss is computed inside the output module's forward on purpose: under FSDP that is where its weight
is the gathered (unsharded) tensor, and where FSDP's backward hooks see the module's output; the fused
kernel's gradients flow back through them like a plain linear's. Without labels (a forward outside
training) it is a plain linear. Where the labels cannot be handed to the output layer's forward
(pipeline stages, context parallelism) or the output is vocab-sharded (tensor parallelism), the
planner leaves torchtitan's output + loss in place (:func:`primus.torchtitan.kernels.plan`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from primus.torchtitan import compat

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402


def token_sum(mean: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss contract (the token *sum*) from a mean over valid tokens; 0 without valid tokens."""
    count = (labels != IGNORE_INDEX).sum()
    return torch.where(count > 0, mean, torch.zeros_like(mean)) * count


class FusedOutput(nn.Linear):
    """torchtitan's output projection (same ``weight``); with :attr:`labels` set it returns the token-loss
    sum of ``h @ weight.T`` against them, from the provider's fused ``linear_cross_entropy``."""

    kernel: Callable[..., torch.Tensor]
    labels: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.labels is None:
            return super().forward(h)
        device = h.device.type
        # The GEMMs run in one dtype: autocast's (bf16 with fp32 params), as F.linear would under it.
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype
        mean = self.kernel(h.to(dtype), self.weight.to(dtype), self.labels, ignore_index=IGNORE_INDEX)
        return token_sum(mean, self.labels)


def fuse_output(model: nn.Module, kernel: Callable[..., torch.Tensor]) -> bool:
    """Retype ``model.output`` (a plain ``nn.Linear`` without bias) to :class:`FusedOutput`; False where the
    model (a pipeline stage without the head) has none."""
    head = getattr(model, "output", None)
    if type(head) is not nn.Linear or head.bias is not None:
        return False
    head.__class__ = FusedOutput
    head.kernel = kernel
    return True


@contextlib.contextmanager
def head_targets(model_parts: list[nn.Module], labels: torch.Tensor) -> Iterator[None]:
    """Hand ``labels`` to the fused output layers of ``model_parts`` for one forward (and take them back).
    Called per micro-batch: only ``part.output`` is looked at, the one place :func:`fuse_output` retypes."""
    heads = [h for part in model_parts if isinstance(h := getattr(part, "output", None), FusedOutput)]
    for head in heads:
        head.labels = labels
    try:
        yield
    finally:
        for head in heads:
            head.labels = None


def head_loss(fallback: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The TrainSpec loss when the head is fused: the head's token-loss sum (a 0-dim tensor) as it is;
    logits (a forward that ran without labels) go to ``fallback``."""

    def loss(pred: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return pred if pred.dim() == 0 else fallback(pred, labels, **kwargs)

    return loss
