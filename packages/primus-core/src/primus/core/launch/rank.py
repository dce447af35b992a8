"""One rank of a run (a process: the user's, or one torchrun started): its side before the engine
(:func:`rank_context`: data refusals, evaluation samples, kernels for this device, the run's facts, the run folder),
then core's loop around the backend's engine (:func:`run_rank`), or the evaluation of a checkpoint
(:func:`eval_rank`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from primus.core.config.schema import PrimusConfig
from primus.core.contracts.engine import RunContext, RunInfo
from primus.core.launch.resolve import Resolved, searched_micro_batches
from primus.core.run.oom import OutOfMemory
from primus.core.run.rundir import LOCK_HELD_ENV, RunFolder

log = logging.getLogger("primus.train")


def rank_context(
    res: Resolved, resume: bool = False, write_config: bool = True, evaluate: bool = False
) -> tuple[PrimusConfig, RunContext]:
    """This rank's side of a run before the engine: data refusals (before anything is written), the evaluation
    samples (with ``eval.interval`` or ``evaluate``), kernels, the run's facts (:class:`RunInfo`), the run folder
    with its ``config.yaml`` (``write_config``)."""
    from primus.core.data.checks import check_data

    check_data(res.config)  # every data refusal comes before anything is written (the run folder included)
    eval_samples = None
    if evaluate or res.config.eval.interval:
        from primus.core.data.splits import eval_samples as build_eval_samples

        eval_samples = build_eval_samples(res.config)  # too few: refused now, before the run folder

    from primus.core.kernels.documents import masks_documents
    from primus.core.kernels.selection import detect_device, select_kernels
    from primus.core.planner.modelmath import count_params, flops_per_token
    from primus.core.run.metrics import peak_flops

    cfg, registry = res.config, res.registry
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if rank != 0 and cfg.logging.level != "debug":  # one voice: the other ranks (and their engines) warn only
        logging.getLogger().setLevel(logging.WARNING)
    device = detect_device()
    from primus.core.run.lazy_compile import defer_torch_compile

    # before the engine's import: its compiled functions cost nothing until they run, and on a CPU they run eager
    defer_torch_compile(eager=device == "cpu")
    device_name = None
    if device != "cpu":
        from primus.core.planner.auto import check_fits

        # the planner's band, before any build: past it refused, inside it warned, each with the planner's pick
        if (
            warning := check_fits(cfg, res.world_size, registry=registry, micro_batch=searched_micro_batches(res))
        ) and rank == 0:
            log.warning("%s", warning)
        import torch

        device_name = torch.cuda.get_device_name(local_rank)
    kernels = select_kernels(
        cfg.kernels,
        registry,
        device,
        documents=masks_documents(cfg),
        moe=cfg.model.moe is not None,
        head_dim=cfg.model.kv_channels,
        dtype=cfg.train.precision,
        cp=cfg.parallel.cp,
    )
    folder = RunFolder(cfg)
    out = folder.path
    if cfg.train.init_from:  # a checkpoint of the other engine becomes a Hugging Face folder, once
        from primus.core.run.health import collective_timeout
        from primus.core.run.init_from import prepare

        cfg = prepare(cfg, rank, out, collective_timeout(cfg.train.health).total_seconds())
    info = RunInfo(
        world_size=res.world_size,
        rank=rank,
        local_rank=local_rank,
        device=device,
        backend=cfg.backend.name,
        output_dir=str(out),
        kernels={op: k.name for op, k in kernels.items()},
        num_params=count_params(cfg.model).total,
        flops_per_token=flops_per_token(cfg.model, cfg.train.seq_len, cfg.train.lora),
        peak_flops=peak_flops(device_name),
        extra={"device_name": device_name or "cpu"},
    )
    if rank == 0 and write_config:
        if not os.environ.get(LOCK_HELD_ENV):  # (core's launcher holds it for the whole job)
            folder.claim(resume)
        folder.write_config(cfg)
        log.info("kernels: %s", ", ".join(f"{op}={name}" for op, name in info.kernels.items()))
    hooks = registry.pm.hook
    ctx = RunContext(
        info=info,
        hooks=hooks,
        kernels=kernels,
        resume=bool(resume or cfg.checkpoint.resume),
        config=cfg,
        eval_samples=eval_samples,
    )
    return cfg, ctx


def run_rank(res: Resolved, resume: bool = False) -> dict[str, Any]:
    """Train on this rank (called once per process)."""
    try:
        cfg, ctx = rank_context(res, resume)
    except BaseException:
        RunFolder(res.config).release()
        raise
    hooks, info = ctx.hooks, ctx.info
    backend = res.registry.backends[cfg.backend.name]
    summary: dict[str, Any] = {"status": "failed"}
    try:
        from primus.core.run.loop import fit

        summary = fit(cfg, ctx, backend)  # core's loop drives the backend's engine (it calls on_train_start)
        summary.setdefault("status", "ok")
        return summary
    except OutOfMemory as exc:
        summary = {"status": "failed", "error": f"out of memory {exc.where}"}
        exc.estimate, exc.instead = memory_advice(cfg, res)
        raise
    except BaseException as exc:
        summary = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        raise
    finally:
        try:
            hooks.primus_on_train_end(summary=summary, info=info)
        finally:
            RunFolder(cfg).release()


def memory_advice(cfg: PrimusConfig, res: Resolved) -> tuple[str, str]:
    """For a run that ran out of memory: the planner's estimate of its layout on this device, and what to type
    instead (the planner's pick for the run)."""
    from primus.core.planner import auto
    from primus.core.planner.memory import GIB
    from primus.core.planner.strategies import estimate_memory

    dev = auto.local_device()
    need = estimate_memory(cfg, res.world_size, res.registry).total / GIB
    instead = auto.advice(cfg, res.world_size, dev, res.registry, searched_micro_batches(res))
    return f"{need:.1f} GiB per device of {dev.memory_gib:.1f} on {dev.name}", instead


def eval_rank(res: Resolved, checkpoint: Path) -> dict[str, Any]:
    """Evaluate a checkpoint on this rank (``primus eval``): no training hooks, nothing written but the engine's
    scratch files under the run folder."""
    from primus.core.run.loop import evaluate_checkpoint

    cfg, ctx = rank_context(res, write_config=False, evaluate=True)
    return evaluate_checkpoint(cfg, ctx, res.registry.backends[cfg.backend.name], checkpoint)
