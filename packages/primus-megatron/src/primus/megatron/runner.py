"""The Megatron-Core backend's ``run(cfg, ctx)``: one call per rank process.

Process groups -> model chunks (kernel layer spec) -> [seed weights] -> Float16Module -> megatron
DDP -> megatron optimizer (+ distributed optimizer) -> LR scheduler -> [resume] -> steps of
``get_forward_backward_func`` over the micro-batches of one global batch -> health check inside the
optimizer step -> metrics and checkpoints.

Health (``train.health``, core's :class:`~primus.core.health.HealthMonitor`): each step's global loss
(all-reduced, NaN on every rank if any rank's is) and grad norm (megatron's, computed inside
``optimizer.step()``; :func:`primus.megatron.compat.optimizer_step` asks the monitor between the
norm and the update) are checked before the update. ``on_nonfinite: stop`` raises
:class:`~primus.core.health.NonFiniteError` naming the step (nothing of it applied or saved; the run
ends failed and earlier checkpoints stay). ``skip``: that step's update is not applied (parameters
and optimizer state unchanged, gradients dropped), the LR schedule does not advance (it counts
applied updates), the step counter and the data move on. ``skipped_steps`` / ``loss_spikes`` join
the metrics. ``collective_timeout_s`` is the timeout of every process group.

Profiling (``profile``): core's :class:`~primus.core.profile.capture.StepProfiler` wraps the loop and
steps after each optimizer step; traces land in ``<output_dir>/traces/rank<r>.json``.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from primus.core.config.schema import PrimusConfig
from primus.core.config.validate import grad_accumulation_steps
from primus.core.health import HealthMonitor, collective_timeout
from primus.core.metrics import Throughput
from primus.core.profile.capture import StepProfiler
from primus.core.protocols import RunContext

log = logging.getLogger("primus.megatron")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_distributed(timeout: timedelta) -> tuple[int, int, str]:
    """Start the process group (megatron needs one even for a single process); returns
    (rank, world size, device type). A collective that hangs longer than ``timeout`` errors out."""
    gpu = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if gpu:
        torch.cuda.set_device(local_rank)
    else:
        from primus.megatron.cpu import redirect_to_cpu

        redirect_to_cpu()
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
            dist.init_process_group("nccl" if gpu else "gloo", timeout=timeout)
        else:
            dist.init_process_group(
                "nccl" if gpu else "gloo",
                init_method=f"tcp://127.0.0.1:{_free_port()}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    return dist.get_rank(), dist.get_world_size(), "cuda" if gpu else "cpu"


def _sharded_optimizer(cfg: PrimusConfig) -> bool:
    """dp_shard > 1 (the default split of a multi-rank world) shards the optimizer state."""
    p = cfg.parallel
    return p.distributed_optimizer or int(p.dp_shard) > 1


def _optimizer_instances(cfg: PrimusConfig) -> int:
    """dp_replicate × dp_shard with both > 1: one optimizer-state shard group per replica."""
    p = cfg.parallel
    return p.dp_replicate if int(p.dp_shard) > 1 and p.dp_replicate > 1 else 1


def _ddp_config(cfg: PrimusConfig, mc: Any) -> Any:
    p = cfg.parallel
    extra = dict(cfg.backend.extra.get("ddp", {}))
    return mc.DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=_sharded_optimizer(cfg),
        check_for_nan_in_grad=False,
        num_distributed_optimizer_instances=_optimizer_instances(cfg),
        **extra,
    )


def _optimizer_config(cfg: PrimusConfig, mc: Any) -> Any:
    t, p = cfg.train, cfg.parallel
    o = t.optimizer
    return mc.OptimizerConfig(
        optimizer="sgd" if o.name == "sgd" else "adam",
        decoupled_weight_decay=o.name != "adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        clip_grad=t.grad_clip,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        params_dtype=torch.float32
        if t.precision == "fp32"
        else (torch.bfloat16 if t.precision == "bf16" else torch.float16),
        use_distributed_optimizer=_sharded_optimizer(cfg),
        overlap_param_gather=p.overlap_param_gather,
    )


def _scheduler(cfg: PrimusConfig, optimizer: Any, mc: Any) -> Any:
    t = cfg.train
    o, s = t.optimizer, t.schedule
    return mc.OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr if s.decay != "constant" else o.lr,
        lr_warmup_steps=s.warmup_steps,
        lr_decay_steps=max(t.steps, s.warmup_steps + 1),
        lr_decay_style=s.decay,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=t.steps,
        wd_incr_style="constant",
    )


def _memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run(cfg: PrimusConfig, ctx: RunContext) -> dict[str, Any]:
    timeout = collective_timeout(cfg.train.health)
    rank, world, device = _init_distributed(timeout)
    from primus.megatron import checkpoint as ckpt
    from primus.megatron import compat as mc
    from primus.megatron.data import build_batches
    from primus.megatron.faults import FaultInjection
    from primus.megatron.gpt import fused_loss
    from primus.megatron.model import build_chunks, transformer_config
    from primus.megatron.rope import rope_impl

    p, t = cfg.parallel, cfg.train
    if cfg.logging.level != "debug":  # megatron logs every config object at INFO
        logging.getLogger("megatron.core").setLevel(logging.WARNING)
    try:
        mc.init_parallel(p.tp, p.pp, p.vpp, p.cp, _optimizer_instances(cfg), timeout.total_seconds())
        mc.seed(t.seed)
        # what RoPE and the output layer + loss run (megatron's own, or a provider's), with the reason
        swapped = {"rope": rope_impl(ctx.kernels)[1], "output_loss": fused_loss(ctx.kernels, p.tp)[1]}
        if rank == 0:
            log.info(
                "megatron layer spec: attention=%s, rms_norm=%s, swiglu=%s from the kernel providers; rope: %s; "
                "output layer + loss: %s",
                *(ctx.info.kernels.get(op) for op in ("attention", "rms_norm", "swiglu")),
                swapped["rope"],
                swapped["output_loss"],
            )
        config = transformer_config(cfg)
        chunks = build_chunks(cfg, config, ctx.kernels)
        out = Path(ctx.info.output_dir)
        layout = {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "world": world}
        faults = FaultInjection.from_extra(cfg.backend.extra)

        if t.init_from_hf:  # HF weights into this rank's TP/PP shard (a seed checkpoint or resume overrides them)
            from primus.megatron.hf import load_hf_into_chunks

            load_hf_into_chunks(chunks, cfg, t.init_from_hf)

        seed_dir = cfg.backend.extra.get("seed_checkpoint")
        if seed_dir:
            seed_path = Path(seed_dir)
            if seed_path.is_dir():
                ckpt.load_seed(seed_path, chunks, cfg)
            else:
                ckpt.save_seed(seed_path, chunks, rank, ckpt.manifest(cfg, 0, layout))

        if t.precision in ("bf16", "fp16"):
            chunks_fp = [mc.Float16Module(config, c) for c in chunks]
        else:
            chunks_fp = chunks
        ddp_config = _ddp_config(cfg, mc)
        model = [
            mc.DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks_fp)
        ]
        for m in model:  # every DP rank built the same weights (same seed); make sure
            m.broadcast_params()
        ctx.model_ready(chunks)
        optimizer = mc.get_megatron_optimizer(_optimizer_config(cfg, mc), model)
        if device != "cpu" and cfg.train.optimizer.name in ("adam", "adamw"):
            mc.fuse_torch_adam(optimizer)
        mc.foreach_multi_tensor()
        scheduler = _scheduler(cfg, optimizer, mc)

        def one_or_list(items: list[Any]) -> Any:
            return items[0] if len(items) == 1 else items

        config.finalize_model_grads_func = mc.finalize_model_grads
        config.no_sync_func = one_or_list([m.no_sync for m in model])
        if p.overlap_grad_reduce:
            config.grad_sync_func = one_or_list([m.start_grad_sync for m in model])
        if p.overlap_param_gather:
            config.param_sync_func = one_or_list([m.start_param_sync for m in model])

        ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints"
        start = 0
        if ctx.resume:
            found = ckpt.latest(ckpt_root)
            if found is not None:
                start = ckpt.load(found[1], chunks, optimizer, scheduler, cfg)
            elif rank == 0:
                log.warning("resume asked for, but %s holds no complete checkpoint: starting at step 0", ckpt_root)

        r = mc.ranks()
        batches = build_batches(cfg, r["dp"], r["dp_size"], torch.cuda.current_device(), out / "megatron_data_cache")
        num_micro = grad_accumulation_steps(cfg)
        assert num_micro == batches.num_micro, (num_micro, batches.num_micro)
        last = [mc.stage(i if p.vpp > 1 else None)[1] for i in range(p.vpp)]
        reports_loss = any(last) and r["tp"] == 0 and r["cp"] == 0
        fb = mc.get_forward_backward_func()

        step_no = 0  # the 1-based step being run (read by the loss function: fault injection)

        def forward_step(data_iterator: Any, model_chunk: Any) -> Any:
            tokens, labels = next(data_iterator)
            losses = model_chunk(tokens, None, None, labels=labels)

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                # Every micro-batch holds the same number of tokens (packed, unmasked), so megatron's
                # mean over micro-batches and DP ranks of per-micro-batch means is the per-token mean
                # of the global batch, without the extra gradient-scaling pass of per-token mode.
                total = faults.poison_loss(step_no, output.float().sum())
                n = float(output.numel())
                # full_like, not new_tensor: a host scalar copied to the GPU would sync mid-step
                return total / n, {"lm loss": torch.stack([total.detach(), torch.full_like(total.detach(), n)])}

            return losses, loss_func

        def global_loss(reduced: list[dict[str, torch.Tensor]]) -> float:
            """The step's per-token loss over the global batch, the same on every rank (NaN if any is)."""
            stats = torch.zeros(2, dtype=torch.float64, device=torch.cuda.current_device())
            if reports_loss and reduced:
                stats += torch.stack([x["lm loss"] for x in reduced]).sum(0).double()
            dist.all_reduce(stats)
            return (stats[0] / stats[1]).item()

        tokens_per_step = int(t.global_batch_size) * t.seq_len
        meter = Throughput(ctx.info.flops_per_token, world, ctx.info.peak_flops)
        health = HealthMonitor(t.health)
        last_metrics: dict[str, float] = {}
        saved = None
        with StepProfiler(cfg, ctx.info) as profiler:
            for step in range(start, t.steps):
                step_no = done = step + 1
                for m in model:
                    m.zero_grad_buffer()
                optimizer.zero_grad()
                scheduler.step(increment=1)  # lr of step `done`: warmup starts above zero
                lr = optimizer.param_groups[0]["lr"]
                micro = batches.micro_batches(step)
                iters: Any = [iter(micro) for _ in model]
                reduced = fb(
                    forward_step_func=forward_step,
                    data_iterator=one_or_list(iters),
                    model=one_or_list(model),
                    num_microbatches=num_micro,
                    seq_length=t.seq_len,
                    micro_batch_size=t.micro_batch_size,
                    forward_only=False,
                )
                loss = global_loss(reduced)
                # Health: with the step's loss and (inside the optimizer step) its grad norm known,
                # before the update: non-finite -> NonFiniteError (stop) or no update (skip).
                applied, grad_norm = mc.optimizer_step(
                    optimizer, lambda norm, loss=loss, done=done: health.check(done, loss, norm) == "ok"
                )
                if not applied:
                    # Skipped: the schedule counts applied updates (as megatron's training loop does),
                    # so the next step runs at this step's lr; the data still moves on (batch = step).
                    scheduler.step(increment=-1)
                profiler.step()
                ctx.train_step(done)
                meter.add(tokens_per_step)
                if done % cfg.logging.interval == 0 or done == t.steps:
                    last_metrics = {
                        "loss": loss,
                        "grad_norm": float(grad_norm if grad_norm is not None else 0.0),
                        "lr": lr,
                        **meter.interval(),
                        "memory_gib": _memory_gib(device),
                        **health.metrics(),
                    }
                    ctx.step_end(done, last_metrics)
                if cfg.checkpoint.enabled and (
                    (cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0) or done == t.steps
                ):
                    if p.overlap_param_gather:  # the model weights lag the optimizer until the gather runs
                        for m in model:
                            m.disable_forward_pre_hook(param_sync=True)
                    saved = ckpt.save(
                        ckpt_root,
                        done,
                        chunks,
                        optimizer,
                        scheduler,
                        rank,
                        cfg.checkpoint.keep_last,
                        ckpt.manifest(cfg, done, layout),
                        before_commit=lambda done=done: faults.during_save(done, rank),
                    )
                    if p.overlap_param_gather:
                        for m in model:
                            m.enable_forward_pre_hook()
                    meter.reset()
        return {
            "final_step": t.steps,
            "start_step": start,
            "metrics": last_metrics,
            "kernels": ctx.info.kernels,
            "kernels_applied": swapped,
            "checkpoint": str(saved) if saved else None,
            **health.metrics(),
        }
    finally:
        mc.destroy_parallel()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
