"""Auxiliary-loss balancing on torchtitan's MoE: core's losses (:mod:`primus.core.run.balancing`) from each router's
logits, in the training objective, and ``moe_aux_loss`` / ``moe_seq_aux_loss`` reported.

torchtitan 0.2.2's MoE has no auxiliary loss. Each MoE layer's router gate (``moe.router.gate``, torchtitan's own
``nn.Linear``) gets a forward hook, registered after the model is parallelized (so under TP it sees the local
logits its TP style hands on): in a training forward with gradients it computes the losses from the logits, adds
them to its layer's interval sums, and returns the logits with ``coeff × loss`` attached (:func:`~primus.core.run.
balancing.attach`), whose gradient is the routed micro-batch's share of the step's objective (:attr:`Balancing.
grad_scale`, set by :class:`~primus.torchtitan.trainer.PrimusTrainer` before each forward-backward). The router,
its top-k and the experts stay torchtitan's (or the kernel providers'); nothing is patched.

The share: ``micro_batch_size / global_batch_size`` (the step's routed micro-batches over all data-parallel ranks;
a pipeline cuts its local batch into micro-batches of the same size), over the TP degree (every TP rank routes the
whole micro-batch and the gate's gradient is summed over TP, :func:`primus.torchtitan.compat.router_gate_partial_grad`),
and under PP times the global token count, which :func:`primus.torchtitan.compat.pp_grad_scale` divides every
gradient by after the step (DDP's correction only undoes its own averaging). Under context parallelism each rank
routes part of every sequence: the counts are summed over the CP group, the scores stay local, and the CP ranks'
losses add up to the micro-batch's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from primus.core.config.schema import PrimusConfig
from primus.core.run.balancing import attach, balancing_scores, switch_loss

# core's metric, the loss (model.moe: balancing aux_loss / seq_aux_loss_coeff)
METRICS = (("moe_aux_loss", "aux_loss"), ("moe_seq_aux_loss", "seq_aux_loss"))


def coefficients(cfg: PrimusConfig) -> dict[str, float]:
    """The auxiliary losses this config trains with, and their weights (none: empty)."""
    e = cfg.model.moe
    if e is None:
        return {}
    out = {"aux_loss": e.aux_loss_coeff if e.balancing == "aux_loss" else 0.0, "seq_aux_loss": e.seq_aux_loss_coeff}
    return {kind: c for kind, c in out.items() if c > 0}


class Balancing:
    """The hooks on this rank's routers and the interval's sums (per global layer: each loss, the routed batches)."""

    def __init__(
        self,
        cfg: PrimusConfig,
        routers: list[tuple[int, Any, Any]],
        device: torch.device | str,
        cp_group: Any = None,
        pipeline: bool = False,
    ) -> None:
        """``routers``: :meth:`~primus.torchtitan.engine.TorchTitanEngine.expert_routers`; ``cp_group``: the context-
        parallel group (None: none); ``pipeline``: the model is a pipeline stage (see :meth:`shape_inference`)."""
        e = cfg.model.moe
        self.coeffs = coefficients(cfg)
        self.kinds = [kind for _, kind in METRICS if kind in self.coeffs]
        self.k, self.score, self.cp_group = e.experts_per_token, e.router, cp_group
        self.cp = dist.get_world_size(cp_group) if cp_group is not None else 1
        self.seq_len = cfg.train.seq_len // self.cp  # each sequence's tokens on this rank
        self.share = cfg.train.micro_batch_size / cfg.train.global_batch_size
        self.grad_scale = self.share  # the trainer sets it for its layout before each forward-backward
        self.sums = torch.zeros(cfg.model.num_layers, len(self.kinds) + 1, dtype=torch.float64, device=device)
        self.layers, self.pipeline = [layer for layer, _, _ in routers], pipeline
        self.inferring: set[int] = set()
        self.shape_inference()
        self.handles = [
            router.gate.register_forward_hook(functools.partial(self._hook, layer)) for layer, router, _ in routers
        ]

    def shape_inference(self) -> None:
        """The next training forward of a pipeline stage is torch's shape inference, not a micro-batch: at a
        schedule's first step, and again at the first after an evaluation (a switch between eval and train), each
        ``PipelineStage`` runs a real forward and backward on stand-in inputs (its metadata inference; the first
        stage's are the batch's, the others' uninitialised). Its losses still join the graph (the inference's
        backward leaves no parameter gradient) but not the interval's sums. Nothing without a pipeline."""
        if self.pipeline:
            self.inferring = set(self.layers)

    def set_layout(self, tp: int, pp_grad_scale: float = 1.0) -> None:
        """The gradient scale of a routed micro-batch's loss: its share of the step, over the TP ranks that route
        it alike, divided by the factor the trainer scales every gradient by after the step (a pipeline's)."""
        self.grad_scale = self.share / (tp * pp_grad_scale)

    def _counts(self, routed: torch.Tensor) -> torch.Tensor:
        counts = routed.sum(dim=-2).float()
        if self.cp_group is not None:  # the whole sequences' counts: every CP rank holds part of each
            dist.all_reduce(counts, group=self.cp_group)
        return counts

    def _hook(self, layer: int, module: Any, _args: Any, logits: torch.Tensor) -> torch.Tensor | None:
        if not (module.training and torch.is_grad_enabled()):  # evaluation: no loss, nothing counted
            return None
        if isinstance(logits, DTensor):  # torchtitan's TP style for the gate hands on a local tensor
            raise RuntimeError(f"layer {layer}: the router gate's output is a DTensor; the losses take a local tensor")
        scores, routed = balancing_scores(logits, self.k, self.score)
        losses: dict[str, torch.Tensor] = {}
        if "aux_loss" in self.coeffs:
            n = scores.shape[0]
            losses["aux_loss"] = switch_loss(scores, self._counts(routed), self.k, tokens=n * self.cp)
        if "seq_aux_loss" in self.coeffs:
            seq = scores.reshape(-1, self.seq_len, scores.shape[-1])
            counts = self._counts(routed.reshape(seq.shape))
            losses["seq_aux_loss"] = switch_loss(seq, counts, self.k, tokens=self.seq_len * self.cp)
        if layer in self.inferring:  # a pipeline stage's shape inference
            self.inferring.discard(layer)
        else:
            with torch.no_grad():
                self.sums[layer, :-1] += torch.stack([losses[kind].detach() for kind in self.kinds]).to(self.sums)
                self.sums[layer, -1] += 1
        total = sum(self.coeffs[kind] * loss for kind, loss in losses.items())
        return attach(logits, total, self.grad_scale)

    def metrics(self) -> dict[str, float]:
        """Each loss's mean over the MoE layers of its mean over the interval's routed micro-batches (the same on
        every rank: call on all ranks at the same steps); starts the next interval. TP ranks route the same batches
        (each counts and sums them alike), CP ranks parts of one (their losses are parts, their counts each whole)."""
        sums = self.sums.clone()
        self.sums.zero_()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        batches = sums[:, -1] / self.cp
        moe = batches > 0
        if not bool(moe.any()):
            return {}
        out = {}
        for i, kind in enumerate(self.kinds):
            metric = next(m for m, k in METRICS if k == kind)
            out[metric] = float((sums[moe, i] / batches[moe]).mean())
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
