"""One run in a process: resolve and validate the config (:func:`resolve`), then on each rank the data checks, the
kernels, the run folder and the engine handed to core's loop (:func:`run_rank`).

One device trains in the user's process; more devices re-run ``primus train`` under torchrun, one process per device
(:mod:`primus.core.launch.launcher`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from primus.core.config.errors import ConfigError
from primus.core.config.loader import Layered, load_layers, nest
from primus.core.config.presets import resolver
from primus.core.config.schema import PrimusConfig
from primus.core.config.validate import resolve_parallel, validate_config
from primus.core.contracts.engine import RunContext, RunInfo
from primus.core.contracts.plugins import Registry, get_registry
from primus.core.hf.peft import init_from_issues
from primus.core.run.init_from import apply_layers
from primus.core.run.oom import OutOfMemory
from primus.core.run.rundir import LOCK_HELD_ENV, hold, output_dir, release

log = logging.getLogger("primus.train")


@dataclass
class Resolved:
    config: PrimusConfig
    layers: Layered
    registry: Registry
    world_size: int


def configure_changes(registry: Registry):
    """Run every plugin's ``primus_configure`` and label its change with the plugin's distribution. Where two
    plugins set one key, the one pluggy calls first wins (``tryfirst``, else the one registered last)."""

    def run(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        changes = []
        for plugin_name, call in registry.pm.each_impl("primus_configure"):
            change = Layered()
            for result in call(config=data):
                for key, value in (result or {}).items():
                    change.merge(nest(key, value), "")
            if change.data:
                changes.append((f"plugin {registry.pm.dist_of(plugin_name)}", change.data))
        return changes[::-1]  # merged in list order: the first called is merged last, so it wins

    return run


def resolve(
    config: str | None,
    overrides: list[str] = (),
    world_size: int | None = None,
    registry: Registry | None = None,
    check_plugins: bool = True,
) -> Resolved:
    """Load, layer and validate; ``check_plugins=False`` skips the checks that need installed plugins
    (backend and kernel names), so ``primus config show`` works with primus-core alone."""
    registry = registry or get_registry()
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    layers = load_layers(config, overrides, resolver(registry), configure=configure_changes(registry))
    apply_layers(layers)  # train.init_from: a Hugging Face folder's config.json is the model's layer
    cfg = validate_config(layers.data, world_size=world_size, registry=registry if check_plugins else None)
    if issues := init_from_issues(cfg.train.lora):  # the config's rules pass; now the folders it names
        raise ConfigError(issues)
    strategy = cfg.parallel.strategy
    if strategy not in ("auto", "manual"):
        from primus.core.contracts.protocols import load_ref

        # a named strategy fills the parallel section; sizes the user set explicitly stay as given
        explicit = {
            k.split(".")[1] for k in layers.sources if k.startswith("parallel.") and layers.sources[k] != "default"
        }
        filled = load_ref(registry.strategies[strategy].fill)(cfg.parallel.model_dump(), world_size, cfg)
        kept = {k: v for k, v in filled.items() if k not in explicit or k == "strategy"}
        data = cfg.model_dump()
        data["parallel"] = {**data["parallel"], **kept}
        cfg = validate_config(data, world_size=world_size, registry=registry if check_plugins else None)
    if cfg.parallel.strategy == "auto":
        from primus.core.planner.auto import choose

        explicit = {k.split(".")[1] for k in layers.sources if k.startswith("parallel.")}
        cfg = validate_config(choose(cfg, explicit, world_size, registry=registry).model_dump(), world_size=world_size)
    return Resolved(resolve_parallel(cfg, world_size), layers, registry, world_size)


def searched_micro_batches(res: Resolved) -> int | tuple[int, ...]:
    """The micro-batch sizes the planner tries for a run: the one given on the command line, else the config's, then
    the others of :data:`~primus.core.planner.search.MICRO_BATCHES` (another is recommended only where it is
    faster)."""
    from primus.core.planner.search import MICRO_BATCHES

    mbs = res.config.train.micro_batch_size
    if res.layers.sources.get("train.micro_batch_size") == "command line":
        return mbs
    return (mbs, *(m for m in MICRO_BATCHES if m != mbs))


EARLIER_RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints")


def check_output_dir(cfg: PrimusConfig, resume: bool) -> None:
    """Refuse to start a fresh run in a folder that holds an earlier run's results (nothing is overwritten);
    ``--resume`` continues it instead."""
    from primus.core.contracts.errors import UserError

    out = output_dir(cfg)
    found = [name for name in EARLIER_RUN_FILES if (out / name).exists() and not _empty_dir(out / name)]
    if found and not (resume or cfg.checkpoint.resume):
        raise UserError(
            f"logging.output_dir {out} holds an earlier run ({', '.join(found)}); pass --resume to "
            "continue it, or choose another logging.output_dir"
        )


def claim_output_dir(cfg: PrimusConfig, resume: bool) -> int | None:
    """Lock the output folder for this run (:func:`primus.core.run.rundir.hold`: refused, naming the holder, while
    another run writes there), then check it again under the lock (:func:`check_output_dir`). The lock's fd."""
    fd = hold(output_dir(cfg))
    try:
        check_output_dir(cfg, resume)
    except BaseException:
        release(output_dir(cfg))
        raise
    return fd


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


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

    from primus.core.kernels import detect_device, select_kernels
    from primus.core.kernels.documents import masks_documents
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
    out = output_dir(cfg)
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
        flops_per_token=flops_per_token(cfg.model, cfg.train.seq_len),
        peak_flops=peak_flops(device_name),
        extra={"device_name": device_name or "cpu"},
    )
    if rank == 0 and write_config:
        if not os.environ.get(LOCK_HELD_ENV):  # (core's launcher holds it for the whole job)
            claim_output_dir(cfg, resume)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
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
        release(output_dir(res.config))
        raise
    hooks, info = ctx.hooks, ctx.info
    backend = res.registry.backends[cfg.backend.name]
    summary: dict[str, Any] = {"status": "failed"}
    try:
        from primus.core.run.loop import train

        summary = train(cfg, ctx, backend)  # core's loop drives the backend's engine (it calls on_train_start)
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
            release(output_dir(cfg))


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
