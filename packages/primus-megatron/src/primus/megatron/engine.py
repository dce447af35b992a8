"""The Megatron-Core backend's adapter for core's training loop (:mod:`primus.core.run.loop`).

``build(cfg, ctx)`` makes megatron's own objects on this rank: process groups -> model chunks (kernel layer
spec) -> [HF / seed weights] -> Float16Module -> megatron DDP, or FSDP2 (:mod:`.fsdp`) -> megatron optimizer (+
distributed optimizer).
:meth:`MegatronEngine.train_step` runs ``get_forward_backward_func`` over the micro-batches of one global batch,
then the optimizer step with core's health gate between megatron's grad norm and the update
(:func:`primus.megatron.compat.optimizer_step`). Steps, the learning rate, metrics, checkpoints and resume are
core's; :meth:`save` / :meth:`load` write and read megatron's dist checkpoint shards (:mod:`.checkpoint`).
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from primus.core.config.schema import PrimusConfig
from primus.core.config.validate import grad_accumulation_steps
from primus.core.contracts.engine import (
    Engine,
    Evaluates,
    IntervalMetrics,
    LoadsNative,
    RoutesExperts,
    RunContext,
    SavesWeights,
    StepResult,
    Summarises,
)
from primus.core.kernels.documents import document_eos, document_ids
from primus.core.kernels.selection import fp8_experts
from primus.core.run.health import collective_timeout
from primus.core.run.metrics import global_token_loss

# megatron-core's FSDP modules announce at import "using Megatron-FSDP" (imported whether or not parallel.fsdp is
# on); set before megatron.core is first imported below, so a run without FSDP does not say it uses it
logging.getLogger("megatron.core.distributed.fsdp").setLevel(logging.WARNING)
from primus.megatron.dist import init_distributed, teardown  # noqa: E402

log = logging.getLogger("primus.megatron")

# core's metric, the key megatron's tracker logs it under, the loss type (primus.megatron.model.balancing_losses)
AUX_LOSSES = (
    ("moe_aux_loss", "load_balancing_loss", "aux_loss"),
    ("moe_seq_aux_loss", "seq_load_balancing_loss", "seq_aux_loss"),
)


def fully_sharded(cfg: PrimusConfig) -> bool:
    """``parallel.fsdp: true`` with dp_shard > 1: PyTorch FSDP2 under megatron (TorchFullyShardedDataParallel)
    shards parameters, gradients and optimizer state over the data-parallel ranks."""
    p = cfg.parallel
    return p.fsdp is True and int(p.dp_shard) > 1


def _sharded_optimizer(cfg: PrimusConfig) -> bool:
    """dp_shard > 1 (the default split of a multi-rank world) shards the optimizer state: megatron's distributed
    optimizer, unless FSDP2 shards it (then the regular optimizer steps each rank's shards)."""
    p = cfg.parallel
    return not fully_sharded(cfg) and (p.distributed_optimizer or int(p.dp_shard) > 1)


def _optimizer_instances(cfg: PrimusConfig) -> int:
    """dp_replicate × dp_shard with both > 1: one optimizer-state shard group per replica."""
    p = cfg.parallel
    return p.dp_replicate if int(p.dp_shard) > 1 and p.dp_replicate > 1 else 1


def _ddp_config(cfg: PrimusConfig) -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig

    p = cfg.parallel
    extra = dict(cfg.backend.extra.get("ddp", {}))
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=_sharded_optimizer(cfg),
        check_for_nan_in_grad=False,
        num_distributed_optimizer_instances=_optimizer_instances(cfg),
        **extra,
    )


def _optimizer_config(cfg: PrimusConfig) -> Any:
    from megatron.core.optimizer import OptimizerConfig

    t, p = cfg.train, cfg.parallel
    o = t.optimizer
    return OptimizerConfig(
        optimizer="sgd" if o.name == "sgd" else "adam",
        decoupled_weight_decay=o.name != "adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        clip_grad=t.grad_clip,
        # a LoRA run trains fp32 adapters alone (the bf16 base frozen): megatron's fp32 optimizer steps them; its
        # bf16 one would keep no master copies and cannot write their state to a checkpoint (it maps the model's
        # bf16 parameters only)
        bf16=t.precision == "bf16" and t.lora is None,
        fp16=t.precision == "fp16",
        params_dtype=torch.float32
        if t.precision == "fp32" or t.lora is not None
        else (torch.bfloat16 if t.precision == "bf16" else torch.float16),
        use_distributed_optimizer=_sharded_optimizer(cfg),
        overlap_param_gather=p.overlap_param_gather,
    )


def _weight_decay_overrides() -> dict[Any, Any]:
    """megatron's ``config_overrides``: core's weight-decay rule (:mod:`primus.core.run.optimizer`), not megatron's
    default (the same for these models: their biases are 1-D too)."""
    from megatron.core.optimizer import ParamKey, ParamPredicate

    from primus.core.run.optimizer import takes_weight_decay

    no_decay = ParamPredicate(name="primus_no_weight_decay", fn=lambda param: not takes_weight_decay(param))
    return {ParamKey(predicate=no_decay): {"wd_mult": 0.0}}


def _one_or_list(items: list[Any]) -> Any:
    return items[0] if len(items) == 1 else items


def set_lr(optimizer: Any, lr: float, weight_decay: float) -> None:
    """What megatron's OptimizerParamScheduler.step writes into each param group, at core's learning rate (norms
    and biases have ``wd_mult`` 0)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


# the engine contract and every optional capability (primus.core.contracts.engine), type-checked by nox -s lint
class MegatronEngine(Engine, Evaluates, RoutesExperts, IntervalMetrics, LoadsNative, SavesWeights, Summarises):
    distributions = ("primus-megatron", "primus-core", "megatron-core", "torch")

    def __init__(self, cfg: PrimusConfig, ctx: RunContext) -> None:
        timeout = collective_timeout(cfg.train.health)
        self.rank, world, self.device = init_distributed(timeout)
        self.cfg = cfg
        try:
            self._build(cfg, ctx, timeout.total_seconds(), world)
        except BaseException as exc:
            # said first: leaving the process group makes the other ranks fail too, and the launcher may stop this
            # one before its traceback is printed
            if not isinstance(exc, KeyboardInterrupt):
                log.exception("rank %d: building the megatron engine failed", self.rank)
            # no barrier: a rank whose build failed would wait there for ranks blocked in the build's collectives
            # (the optimizer's all-gather) until the collective timeout, and say nothing until then
            teardown(failed=True)
            raise

    def _build(self, cfg: PrimusConfig, ctx: RunContext, timeout_s: float, world: int) -> None:
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.module import Float16Module

        from primus.megatron import compat as mc
        from primus.megatron.data import build_batches
        from primus.megatron.dist import init_parallel, ranks, seed, stage
        from primus.megatron.faults import FaultInjection
        from primus.megatron.gpt import fused_loss
        from primus.megatron.model import build_chunks, transformer_config
        from primus.megatron.rope import rope_impl

        self.mc = mc
        p, t = cfg.parallel, cfg.train
        if cfg.logging.level != "debug":  # megatron logs every config object at INFO
            logging.getLogger("megatron.core").setLevel(logging.WARNING)
        # megatron-core 0.16's own default cuda_graph_scope ("full") warns on every TransformerConfig it builds
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        init_parallel(p.tp, p.pp, p.vpp, p.cp, _optimizer_instances(cfg), timeout_s, ep=p.ep)
        seed(t.seed)
        # what RoPE and the output layer + loss run (megatron's own, or a provider's), with the reason
        swapped = {"rope": rope_impl(ctx.kernels)[1], "output_loss": fused_loss(ctx.kernels, cfg)[1]}
        if self.rank == 0:
            log.info(
                "megatron layer spec: attention=%s, rms_norm=%s, swiglu=%s from the kernel providers; rope: %s; "
                "output layer + loss: %s",
                *(ctx.info.kernels.get(op) for op in ("attention", "rms_norm", "swiglu")),
                swapped["rope"],
                swapped["output_loss"],
            )
        self.experts_layout = None
        if cfg.model.moe is not None:
            from primus.megatron.layer_spec import experts_impl, experts_layout

            swapped["experts"] = experts_impl(ctx.kernels)[1]
            if cfg.kernels.fp8 != "off":
                why = fp8_experts(cfg.kernels, ctx.kernels["fp8"])[1]
                swapped["experts"] += f"; in the FP8 blocks {why} (provider {ctx.kernels['fp8'].name!r})"
            swapped["moe_permute"] = "megatron's token dispatcher (moe_utils.permute / unpermute)"
            swapped["moe_router"] = "megatron's TopKRouter"
            self.experts_layout = experts_layout(ctx.kernels)
            if self.rank == 0:
                log.info("megatron routed experts: %s", swapped["experts"])
        self.summary = {"kernels_applied": swapped}
        config = transformer_config(cfg)
        self.chunks = chunks = build_chunks(cfg, config, ctx.kernels)
        self.model_parts = chunks
        self.layout = {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "world": world}
        self.faults = FaultInjection.from_extra(cfg.backend.extra)
        self._count_router_calls()
        self._mtp_steps = 0  # training steps since the last interval_metrics (their MTP losses are tracked)

        if t.init == "canonical":  # core's initial weights, the same on every layout and engine
            from primus.megatron.hf import init_canonical

            init_canonical(chunks, cfg)
        if t.init_from:  # HF or megatron weights into this rank's TP/PP shard (resume overrides)
            from primus.megatron.hf import load_init_from

            load_init_from(chunks, cfg)

        chunks_fp = [Float16Module(config, c) for c in chunks] if t.precision in ("bf16", "fp16") else chunks
        if t.lora is not None:  # after the cast: the frozen base in bf16, the adapters fp32 (primus.megatron.lora)
            from primus.megatron.lora import attach

            attach(chunks, cfg)
        if fully_sharded(cfg):
            from primus.megatron.fsdp import FSDP2

            per_token = t.objective == "sft"
            self.model = model = [FSDP2(config, _ddp_config(cfg), c, per_token) for c in chunks_fp]
        else:
            self.model = model = [
                DistributedDataParallel(config, _ddp_config(cfg), c, disable_bucketing=i > 0)
                for i, c in enumerate(chunks_fp)
            ]
        for m in model:  # every DP rank built the same weights (same seed); make sure
            m.broadcast_params()
        self.optimizer = get_megatron_optimizer(_optimizer_config(cfg), model, _weight_decay_overrides())
        if self.device != "cpu" and t.optimizer.name in ("adam", "adamw"):
            mc.fuse_torch_adam(self.optimizer)
        mc.foreach_multi_tensor()

        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = _one_or_list([m.no_sync for m in model])
        if p.overlap_grad_reduce:
            config.grad_sync_func = _one_or_list([m.start_grad_sync for m in model])
        if p.overlap_param_gather:
            config.param_sync_func = _one_or_list([m.start_param_sync for m in model])

        r = ranks()
        out = Path(ctx.info.output_dir)
        self.batches = build_batches(
            cfg, r["dp"], r["dp_size"], torch.cuda.current_device(), out / "megatron_data_cache"
        )
        self.num_micro = grad_accumulation_steps(cfg)
        assert self.num_micro == self.batches.num_micro, (self.num_micro, self.batches.num_micro)
        last = [stage(i if p.vpp > 1 else None)[1] for i in range(p.vpp)]
        # every context-parallel rank holds its own tokens' losses; tp ranks hold the same ones
        self.reports_loss = any(last) and r["tp"] == 0
        self.fb = get_forward_backward_func()
        self.document_eos = document_eos(cfg)

    def _forward_step(self, step: int):
        from primus.core.data.sft import IGNORE_INDEX

        faults = self.faults
        # Fine-tuning: labels of context tokens are IGNORE_INDEX (primus.core.data.sft), and megatron runs in its
        # per-token loss mode (``calculate_per_token_loss``, set at build): each micro-batch returns its masked loss
        # sum and trainable-token count, and megatron scales the gradients by the global count.
        masked = self.cfg.train.objective == "sft"
        cp = self.cfg.parallel.cp
        eos = self.document_eos
        cp_batch = self.mc.batch_on_this_cp_rank
        mtp = self.cfg.model.mtp is not None

        def forward_step(data_iterator: Any, model_chunk: Any) -> Any:
            tokens, labels, *carried = next(data_iterator)  # carried: packed chats' documents (core's data)
            # multi-token prediction rolls the positions with the tokens (megatron's MTP layers); RoPE needs none
            positions = (
                torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens).contiguous() if mtp else None
            )
            if cp > 1:  # this rank's chunks r and 2·cp-1-r of 2·cp: causal work balanced over the ranks
                batch = cp_batch({"tokens": tokens, "labels": labels, "positions": positions})
                tokens, labels, positions = batch["tokens"], batch["labels"], batch["positions"]
            mask = labels != IGNORE_INDEX if masked else None
            target = labels if mask is None else torch.where(mask, labels, torch.zeros_like(labels))
            # data.document_mask: each position's document rides in megatron's attention_mask slot, which hands it
            # unchanged to the core attention (KernelCoreAttention); every pipeline stage reads its own tokens
            documents = carried[0] if carried else None if eos is None else document_ids(tokens, eos)
            # (multi-token prediction's losses skip the masked labels too)
            losses = model_chunk(tokens, positions, documents, labels=target, **({"loss_mask": mask} if mtp else {}))

            def loss_func(output: torch.Tensor) -> tuple:
                if mask is not None:
                    total = faults.poison_loss(step, (output.float() * mask).sum())
                    n = mask.sum().to(torch.int)
                    return total, n, {"lm loss": torch.stack([total.detach(), n.to(total.dtype)])}
                # Every micro-batch holds the same number of tokens (packed, unmasked), so megatron's
                # mean over micro-batches and DP (x CP) ranks of per-micro-batch means is the per-token mean
                # of the global batch, without the extra gradient-scaling pass of per-token mode. The three-value
                # return has the schedule divide by the count (its two-value form also multiplies by the CP
                # size, for a loss that is not the mean over this rank's tokens: twice the gradient at cp 2).
                total = faults.poison_loss(step, output.float().sum())
                # full_like, not new_tensor: a host scalar copied to the GPU would sync mid-step
                n = torch.full_like(total.detach(), output.numel(), dtype=torch.int)
                return total, n, {"lm loss": torch.stack([total.detach(), n.to(total.dtype)])}

            return losses, loss_func

        return forward_step

    def _loss_sums(self, reduced: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """(token-loss sum, tokens) of this rank's micro-batches; zeros where this rank does not report the loss
        (pipeline stages before the last, tp / cp ranks but the first), so one all-reduce gives the global pair."""
        stats = torch.zeros(2, dtype=torch.float64, device=torch.cuda.current_device())
        if self.reports_loss and reduced:
            stats += torch.stack([x["lm loss"] for x in reduced]).sum(0).double()
        return stats

    def expert_routers(self) -> list[tuple[int, Any, Any]]:
        """megatron's routers on this rank with their global layer (0-based; multi-token-prediction depths after the
        decoder's layers: :func:`primus.megatron.compat.router_layer`) and the tokens per expert from their output
        ``(probs, routing_map [tokens, experts])``."""
        from megatron.core.transformer.moe.router import TopKRouter

        return [
            (self.mc.router_layer(m), m, lambda out: out[1].sum(0))
            for chunk in self.chunks
            for m in chunk.modules()
            if isinstance(m, TopKRouter)
        ]

    def interval_metrics(self) -> dict[str, float]:
        return {**self._aux_loss_metrics(), **self._mtp_metrics()}

    def _mtp_metrics(self) -> dict[str, float]:
        """``mtp_loss``: multi-token prediction's cross-entropy (before model.mtp.loss_scale), mean over its depths and
        the interval's micro-batches, from megatron's record of it (each training forward adds its micro-batch mean
        per depth on the last pipeline stage; tensor-parallel ranks hold the same, data- and context-parallel ranks
        their own)."""
        if self.cfg.model.mtp is None:
            return {}
        values = self.mc.take_mtp_losses()  # (and cleared)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.reports_loss and values is not None:
            sums[0] = values.double().mean()
            sums[1] = self._mtp_steps * self.num_micro
        if dist.is_initialized():
            dist.all_reduce(sums)
        self._mtp_steps = 0
        return {"mtp_loss": float(sums[0] / sums[1])} if sums[1] > 0 else {}

    def _aux_loss_metrics(self) -> dict[str, float]:
        """``moe_aux_loss`` and ``moe_seq_aux_loss`` (core's definitions, primus.core.run.expert_load.METRICS) from
        megatron's own record of them (its routers add each micro-batch's load-balancing loss per layer to a
        tracker), per routed batch: the routers' training forwards are counted here (a recomputed forward logs, and
        is counted, again), tensor- and context-parallel ranks hold parts of one batch's loss (megatron's Switch
        formula sums them), data-parallel ranks their own batches', pipeline stages their own layers'."""
        if self._router_calls is None:
            return {}
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        n = len(self._router_calls)
        tracked = [(metric, key) for metric, key, kind in AUX_LOSSES if self._aux_losses.get(kind)]
        sums = torch.zeros(len(tracked) + 1, n, dtype=torch.float64, device=self.device)
        for i, (_, key) in enumerate(tracked):
            entry = get_moe_layer_wise_logging_tracker().get(key)
            if entry is not None:  # a stage of dense layers only has none, and still takes part in the sum
                sums[i] = entry["values"][:n].to(sums)
        sums[-1] = torch.tensor(self._router_calls, dtype=sums.dtype)
        if dist.is_initialized():
            dist.all_reduce(sums)
        clear_aux_losses_tracker()
        self._router_calls[:] = [0] * n  # in place: the routers' hooks hold this list
        p = self.cfg.parallel
        batches = sums[-1] / (p.tp * p.cp)  # routed batches: tp × cp ranks route the parts of one
        moe = batches > 0
        if not bool(moe.any()):
            return {}
        return {metric: float((sums[i][moe] / batches[moe]).mean()) for i, (metric, _) in enumerate(tracked)}

    def _count_router_calls(self) -> None:
        """With an auxiliary balancing loss: count each router's training forwards (what megatron's tracker sums
        over)."""
        self._router_calls = None
        e = self.cfg.model.moe
        from primus.megatron.model import balancing_losses

        self._aux_losses = dict(balancing_losses(e)) if e is not None else {}
        if not any(self._aux_losses.values()):
            return
        m = self.cfg.model  # (megatron's tracker has a row for each multi-token-prediction depth's router too)
        self._router_calls = calls = [0] * (m.num_layers + (m.mtp.layers if m.mtp is not None else 0))

        def count(layer: int, module: Any, _args: Any, _out: Any) -> None:
            if module.training and torch.is_grad_enabled():  # evaluation logs no aux loss
                calls[layer] += 1

        for layer, module, _ in self.expert_routers():
            module.register_forward_hook(functools.partial(count, layer))

    def train_step(self, step: int, lr: float, gate: Any) -> StepResult:
        t = self.cfg.train
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        set_lr(self.optimizer, lr, t.optimizer.weight_decay)
        reduced = self._schedule(lambda: self.batches.micro_batches(step - 1), step, forward_only=False)
        loss = global_token_loss(self._loss_sums(reduced))
        # with the loss and (inside the optimizer step) the grad norm known, before the update
        applied, grad_norm = self.mc.optimizer_step(self.optimizer, lambda norm: gate(loss, norm))
        self._mtp_steps += 1
        return StepResult(loss=loss, grad_norm=float(grad_norm) if grad_norm is not None else None, applied=applied)

    def _schedule(self, micro_batches: Any, step: int, forward_only: bool) -> list[dict[str, torch.Tensor]]:
        """megatron's forward(-backward) schedule over one global batch (``micro_batches()``: this rank's, one
        iterator per model chunk)."""
        t = self.cfg.train
        iters: Any = [iter(micro_batches()) for _ in self.model]
        return self.fb(
            forward_step_func=self._forward_step(step),
            data_iterator=_one_or_list(iters),
            model=_one_or_list(self.model),
            num_microbatches=self.num_micro,
            seq_length=t.seq_len,
            micro_batch_size=t.micro_batch_size,
            forward_only=forward_only,
        )

    def evaluate(self, samples: Any, batches: int) -> float:
        """Forward only through megatron's schedule (``forward_only=True``: its no-pipelining or pipelined
        forward), over ``batches`` global batches of ``samples`` in order; model weights, gradients, optimizer
        state and the training batches untouched."""
        from primus.megatron.data import Batches
        from primus.megatron.dist import ranks

        r = ranks()
        loader = Batches(samples, self.cfg, r["dp"], r["dp_size"], torch.cuda.current_device(), shuffle=False)
        stats = torch.zeros(2, dtype=torch.float64, device=torch.cuda.current_device())
        for m in self.model:
            m.eval()
        try:
            with torch.no_grad():
                for b in range(batches):
                    stats += self._loss_sums(self._schedule(lambda b=b: loader.micro_batches(b), 0, forward_only=True))
        finally:
            for m in self.model:
                m.train()
        return global_token_loss(stats)

    def save(self, folder: Path) -> None:
        from primus.megatron import checkpoint as ckpt

        gathering = self.cfg.parallel.overlap_param_gather
        if gathering:  # the model weights lag the optimizer until the gather runs
            for m in self.model:
                m.disable_forward_pre_hook(param_sync=True)
        ckpt.write(folder, self.chunks, self.optimizer, self.experts_layout)
        if gathering:
            for m in self.model:
                m.enable_forward_pre_hook()

    def save_weights(self, folder: Path) -> None:
        from primus.megatron import checkpoint as ckpt

        ckpt.write_weights(folder, self.chunks)

    def load(self, folder: Path) -> None:
        from primus.core.contracts.errors import UserError
        from primus.megatron import checkpoint as ckpt
        from primus.megatron.dist import ranks

        sharded = _sharded_optimizer(self.cfg)
        adam = self.cfg.train.optimizer.name in ("adam", "adamw")
        if sharded and adam and ckpt.optimizer_sharded(folder) is False:
            # the regular optimizer's state is per model tensor (a one-process run's, an import's): the distributed
            # optimizer takes its ranges of each, however this run holds its experts
            from primus.megatron.native_load import read_regular_into_distributed

            read_regular_into_distributed(folder, self.chunks, self.optimizer)
            return
        why = None
        if self.cfg.model.moe is not None:
            chained = len(getattr(self.optimizer, "chained_optimizers", [])) > 1
            why = ckpt.experts_mismatch(folder, chained, self.cfg.parallel.tp, self.cfg.parallel.ep)
            why = why or ckpt.experts_layout_mismatch(folder, self.experts_layout)
        why = why or ckpt.optimizer_mismatch(folder, sharded, ranks()["dp_size"])
        if why:
            raise UserError(why)  # before anything is read: the same decision on every rank
        ckpt.read(folder, self.chunks, self.optimizer)

    def load_native(self, found: Any, weights_only: bool) -> None:
        """A Megatron-LM torch_dist checkpoint (``primus checkpoint import --from``; :mod:`primus.megatron.native`
        recognised it): its model into this engine's chunks and, unless ``weights_only``, its Adam state into the
        optimizer, whatever layout saved it (:mod:`primus.megatron.native_load`)."""
        from primus.core.contracts.errors import UserError
        from primus.megatron.native_load import load

        if not weights_only and self.cfg.train.optimizer.name not in ("adam", "adamw"):
            raise UserError(
                f"{found.folder} holds Adam's state and train.optimizer.name is {self.cfg.train.optimizer.name!r}: "
                "import it with adam or adamw (the optimizer it was trained with)"
            )
        dtype = found.details.get("dtype")
        if dtype and dtype != self.cfg.train.precision and self.rank == 0:
            log.warning(
                "%s was trained in %s and this engine is built in %s (train.precision): its weights are held in %s "
                "here%s",
                found.folder,
                dtype,
                self.cfg.train.precision,
                self.cfg.train.precision,
                ", its fp32 master weights in the optimizer state" if not weights_only else "",
            )
        if found.optimizer_dropped and self.rank == 0:
            log.warning("%s: %s", found.folder, found.optimizer_dropped)
        load(found, self.chunks, self.optimizer, weights_only)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        teardown()


def build(cfg: PrimusConfig, ctx: RunContext) -> MegatronEngine:
    return MegatronEngine(cfg, ctx)
