"""Run a validated Primus config on TorchTitan's own Trainer (once per rank).

The run builds torchtitan's JobConfig from the Primus config, registers a TrainSpec holding the
model args (flavor ``primus``), Primus's data loader and metrics processor, and hands both to
:class:`PrimusTrainer`: torchtitan's ``Trainer`` with two gradient-scale corrections (see
:mod:`primus.torchtitan.compat`). Model code, parallelize functions, pipeline schedules, optimizer,
LR schedule and checkpointer are torchtitan's (its saves made atomic and its resume manifest-based by
:mod:`primus.torchtitan.checkpoint`).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from primus.core.config.schema import PrimusConfig
from primus.core.kernels.fp8_recipe import fp8_output_head
from primus.core.protocols import RunContext

log = logging.getLogger("primus.torchtitan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env() -> None:
    """torchtitan initialises torch.distributed from the torchrun environment; provide it for one process."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def checkpoint_dir(cfg: PrimusConfig) -> Path:
    from primus.core.train import output_dir

    return Path(cfg.checkpoint.dir or output_dir(cfg) / "checkpoints").absolute()


def _exit_quietly_after_success() -> None:
    """gloo runs with a DeviceMesh abort at interpreter teardown about one time in ten, after the work
    is done and the process group destroyed ("terminate called without an active exception"). Once the
    run has succeeded, flush and leave without that teardown."""

    def leave() -> None:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    failed = []
    prev_hook = sys.excepthook

    def hook(*args: Any) -> None:
        failed.append(True)
        prev_hook(*args)

    sys.excepthook = hook
    atexit.register(lambda: None if failed else leave())


def kernel_plan(cfg: PrimusConfig, ctx: RunContext) -> dict[str, Any]:
    """op -> :class:`primus.torchtitan.kernels.Choice`: what this run swaps into torchtitan's model."""
    from primus.torchtitan import compat
    from primus.torchtitan.kernels import plan

    loss_parallel = not compat.extra_value(cfg.backend.extra, "parallelism.disable_loss_parallel", False)
    p = cfg.parallel
    choices = plan(
        ctx.kernels,
        family=cfg.model.family,
        tp=p.tp,
        cp=p.cp,
        pp=p.pp,
        loss_parallel=loss_parallel,
        fp8_head=fp8_output_head(cfg.kernels),
    )
    if "fp8" in ctx.kernels:
        from primus.torchtitan import fp8

        choices["fp8"] = fp8.choice(cfg, ctx.kernels["fp8"])
    return choices


def build_trainer(cfg: PrimusConfig, ctx: RunContext, kernels: dict[str, Any] | None = None) -> Any:
    from primus.core.health import HealthMonitor
    from primus.core.profile.capture import StepProfiler
    from primus.torchtitan import compat

    device = ctx.info.device
    compat.import_torchtitan(device)

    from primus.torchtitan.data import dataloader_builder
    from primus.torchtitan.metrics import metrics_builder
    from primus.torchtitan.models import FLAVOR, engine_model, train_spec
    from primus.torchtitan.trainer import PrimusTrainer

    name = f"primus_{engine_model(cfg.model)}"
    spec = train_spec(
        cfg.model,
        cfg.train.seq_len,
        build_dataloader_fn=dataloader_builder(cfg),
        build_metrics_processor_fn=metrics_builder(ctx),
        cpu=device == "cpu",
        kernels=kernels,
    )
    if cfg.train.init_from_hf:  # torchtitan's checkpointer maps HF names through the spec's adapter
        import dataclasses

        from primus.torchtitan.hf import adapter_cls

        spec = dataclasses.replace(spec, state_dict_adapter=adapter_cls(cfg.model))
    compat.register_train_spec(name, spec)
    job_config = compat.build_job_config(
        cfg,
        model_name=name,
        flavor=FLAVOR,
        output_dir=ctx.info.output_dir,
        checkpoint_dir=str(checkpoint_dir(cfg)),
        gpu=device != "cpu",
    )
    if cfg.train.init_from_hf:
        from primus.torchtitan.hf import init_from_hf

        init_from_hf(job_config, cfg)
    return PrimusTrainer(
        job_config,
        health=HealthMonitor(cfg.train.health),
        profiler=StepProfiler(cfg, ctx.info),
        on_step=ctx.train_step,
        checkpoint_manager=atomic_checkpoints(cfg, ctx),
    )


def atomic_checkpoints(cfg: PrimusConfig, ctx: RunContext) -> Any:
    """Builds torchtitan's checkpointer as Primus's atomic one (tmp folder, manifest, rename)."""
    import functools

    from primus.torchtitan.checkpoint import AtomicCheckpointManager, CheckpointContext, layout
    from primus.torchtitan.faults import FaultInjection

    context = CheckpointContext(cfg, layout(cfg, ctx.info.world_size), FaultInjection.from_extra(cfg.backend.extra))
    return functools.partial(AtomicCheckpointManager, primus=context)


def run(cfg: PrimusConfig, ctx: RunContext) -> dict[str, Any]:
    import torch

    from primus.torchtitan import compat

    if ctx.info.device == "cpu" and (why := compat.cpu_refusal(cfg)):
        raise RuntimeError(f"the torchtitan backend cannot run this on a CPU: {why}")
    compat.import_torchtitan(ctx.info.device)
    from primus.torchtitan import checkpoint as ckpt

    ckpt_dir = checkpoint_dir(cfg)
    seed_only = bool(compat.extra_value(cfg.backend.extra, "checkpoint.create_seed_checkpoint", False))
    if seed_only and ctx.info.world_size > 1:
        raise RuntimeError("a seed checkpoint is written by one process (unsharded): run it without --nproc-per-node")
    found = ckpt.complete_steps(ckpt_dir) if cfg.checkpoint.enabled else []
    if found and not ctx.resume and not seed_only:
        raise RuntimeError(
            f"{ckpt_dir} holds checkpoints of an earlier run (steps {found}); pass --resume to "
            "continue from the newest, or use another logging.output_dir / checkpoint.dir"
        )
    if ctx.resume and not found:
        log.warning("--resume: no complete checkpoint in %s; starting from step 0", ckpt_dir)
    if ctx.resume and found:  # refuse another model shape before building anything
        ckpt.check_compatible(ckpt.NAMING.folder(ckpt_dir, found[-1]), cfg)
    if ctx.info.world_size == 1:
        _single_process_env()
    if ctx.info.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)  # torchtitan logs to the root logger on every rank

    kernels = kernel_plan(cfg, ctx)
    if ctx.info.rank == 0:
        for choice in kernels.values():
            log.info("torchtitan kernels: %s", choice.describe())
    trainer = build_trainer(cfg, ctx, kernels)
    ctx.model_ready(trainer.model_parts)
    summary: dict[str, Any] = {"backend": "torchtitan"}
    try:
        if seed_only:
            trainer.checkpointer.save(curr_step=0, last_step=True)
            summary["seed_checkpoint"] = str(ckpt.NAMING.folder(ckpt_dir, 0))
        else:
            trainer.train()
            summary["final_step"] = trainer.step
            summary["last_metrics"] = trainer.metrics_processor.last
            summary.update(trainer.health.metrics())
            summary["kernels"] = {op: c.provider if c.fn else "torchtitan" for op, c in kernels.items()}
            steps = ckpt.complete_steps(ckpt_dir) if cfg.checkpoint.enabled else []
            if steps:
                summary["checkpoint"] = str(ckpt.NAMING.folder(ckpt_dir, steps[-1]))
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        if ctx.info.world_size > 1:
            _exit_quietly_after_success()
    return summary
