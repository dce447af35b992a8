"""megatron-core's GPTModel with its output layer and loss as one fused call.

megatron's post-process stage computes ``logits = output_layer(h)`` ([s, b, vocab/tp], in the model
dtype) and then ``compute_language_model_loss`` (vocab-parallel cross-entropy with an fp32 copy of the
logits). Where the ``cross_entropy`` provider offers ``linear_cross_entropy`` and the output layer holds
the whole vocabulary (TP = 1), :class:`FusedLossGPTModel` computes the loss from the hidden states and
the output weight (the shared embedding when tied) without the logits. The model object, its modules,
parameters and state-dict keys stay megatron's (only the instance's class changes, see
:func:`fuse_loss`); a forward without labels still returns megatron's logits.

The fused kernel returns the mean over tokens; megatron's loss function wants per-token losses
``[b, s]``, so the mean is broadcast to that shape: the same sum and count, and the same gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from primus.core.config.schema import PrimusConfig
from primus.core.contracts.protocols import KernelProvider
from primus.core.planner.engine_profile import fused_loss_refusal


class FusedLossGPTModel(GPTModel):
    """GPTModel whose post-process stage, given labels, returns the fused linear + cross-entropy loss."""

    linear_cross_entropy: Callable[..., torch.Tensor]

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, **kwargs: Any):
        # megatron's own path without labels, off the last stage, for inference, and where a caller hands 0.19's
        # _postprocess an output_processor (its own output layer + loss)
        plain = (
            labels is None
            or not self.post_process
            or kwargs.get("inference_context") is not None
            or kwargs.get("output_processor") is not None
        )
        if plain:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, **kwargs)
        if self.share_embeddings_and_output_weights:
            weight = self.shared_embedding_or_output_weight()
        else:
            weight = self.output_layer.weight
        # hidden states are [s, b, d]: labels [b, s] -> [s, b] puts them in the same token order
        mean = self.linear_cross_entropy(hidden_states, weight, labels.transpose(0, 1))
        return mean.expand(labels.shape)


def fused_loss(kernels: dict[str, KernelProvider], cfg: PrimusConfig) -> tuple[Callable[..., torch.Tensor] | None, str]:
    """The provider's fused linear + cross-entropy for this run (None: megatron's output layer + loss), and why: its
    tensor parallelism and multi-token prediction decide (core's rule, ``fused_loss_refusal``)."""
    prov = kernels.get("cross_entropy")
    fn = getattr(prov.load(), "linear_cross_entropy", None) if prov is not None else None
    if fn is None:
        name = prov.name if prov is not None else "none"
        return None, f"cross_entropy provider {name!r} offers no fused linear + cross-entropy: megatron's own"
    if why := fused_loss_refusal("megatron", tp=cfg.parallel.tp, mtp=cfg.model.mtp is not None):
        return None, f"{why}: megatron's vocab-parallel loss"
    return fn, f"{prov.name} fused linear + cross-entropy"


def fuse_loss(model: GPTModel, fn: Callable[..., torch.Tensor]) -> GPTModel:
    """Retype ``model`` (a GPTModel just built) to :class:`FusedLossGPTModel` computing its loss with ``fn``."""
    model.__class__ = FusedLossGPTModel
    model.linear_cross_entropy = fn
    return model
