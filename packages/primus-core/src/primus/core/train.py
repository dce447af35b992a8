"""One run: resolve and validate the config, select kernels, hand over to the backend on each rank.

``launch`` runs in the user's process: one device trains in process; more devices re-run ``primus
train`` under ``torch.distributed.run`` (torchrun), one process per device.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from primus.core.config.loader import Layered, load_layers, nest
from primus.core.config.schema import PrimusConfig
from primus.core.config.validate import resolve_parallel, validate_config
from primus.core.init_from import apply_layers
from primus.core.plugins import Registry, get_registry
from primus.core.presets import resolver
from primus.core.protocols import RunContext, RunInfo
from primus.core.rundir import output_dir
from primus.core.stop import TORCHRUN_SIGNALS

log = logging.getLogger("primus.train")

LAUNCHED_ENV = "PRIMUS_LAUNCHED"


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
    strategy = cfg.parallel.strategy
    if strategy not in ("auto", "manual"):
        from primus.core.protocols import load_ref

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


EARLIER_RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints")


def check_output_dir(cfg: PrimusConfig, resume: bool) -> None:
    """Refuse to start a fresh run in a folder that holds an earlier run's results (nothing is overwritten);
    ``--resume`` continues it instead."""
    from primus.core.errors import UserError

    out = output_dir(cfg)
    found = [name for name in EARLIER_RUN_FILES if (out / name).exists() and not _empty_dir(out / name)]
    if found and not (resume or cfg.checkpoint.resume):
        raise UserError(
            f"logging.output_dir {out} holds an earlier run ({', '.join(found)}); pass --resume to "
            "continue it, or choose another logging.output_dir"
        )


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
    from primus.core.metrics import peak_flops
    from primus.core.modelmath import count_params, flops_per_token

    cfg, registry = res.config, res.registry
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = detect_device()
    from primus.core.lazy_compile import defer_torch_compile

    defer_torch_compile()  # before the engine's import: its compiled functions cost nothing until they run
    device_name = None
    if device != "cpu":
        from primus.core.planner.auto import check_fits

        check_fits(cfg, res.world_size, registry=registry)  # a layout that cannot fit: refused before any build
        import torch

        device_name = torch.cuda.get_device_name(local_rank)
    kernels = select_kernels(
        cfg.kernels,
        registry,
        device,
        documents=cfg.data.document_mask,
        moe=cfg.model.moe is not None,
        head_dim=cfg.model.kv_channels,
        dtype=cfg.train.precision,
        cp=cfg.parallel.cp,
    )
    out = output_dir(cfg)
    if cfg.train.init_from:  # a checkpoint of the other engine becomes a Hugging Face folder, once
        from primus.core.health import collective_timeout
        from primus.core.init_from import prepare

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
    cfg, ctx = rank_context(res, resume)
    hooks, info = ctx.hooks, ctx.info
    backend = res.registry.backends[cfg.backend.name]
    summary: dict[str, Any] = {"status": "failed"}
    try:
        if backend.engine is not None:  # core's loop drives the backend's adapter (it calls on_train_start)
            from primus.core.loop import train

            summary = train(cfg, ctx, backend)
        else:
            hooks.primus_on_train_start(config=cfg, info=info)
            summary = dict(backend.load_run()(cfg, ctx) or {})
        summary.setdefault("status", "ok")
        return summary
    except BaseException as exc:
        summary = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        raise
    finally:
        hooks.primus_on_train_end(summary=summary, info=info)


def eval_rank(res: Resolved, checkpoint: Path) -> dict[str, Any]:
    """Evaluate a checkpoint on this rank (``primus eval``): no training hooks, nothing written but the engine's
    scratch files under the run folder."""
    from primus.core.errors import UserError
    from primus.core.loop import evaluate_checkpoint

    cfg, ctx = rank_context(res, write_config=False, evaluate=True)
    backend = res.registry.backends[cfg.backend.name]
    if backend.engine is None:
        raise UserError(f"backend {cfg.backend.name!r} has no engine adapter: primus eval needs one")
    return evaluate_checkpoint(cfg, ctx, backend, checkpoint)


def torchrun_command(
    argv: list[str],
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    rdzv: str | None = None,
) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}"]
    if rdzv:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}"]
    else:
        cmd += [f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}"]
    return [*cmd, "-m", "primus.core.cli", *argv]


#: torchrun forwards these to its workers (SIGUSR1: what Slurm sends before a time limit or preemption) and waits
#: this long for them to commit their checkpoint before it kills them (torchrun reads its options from PET_*).
TORCHRUN_ENV = {"PET_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS, "PET_SHUTDOWN_TIMEOUT": "600"}


#: torchrun's own report that a worker exited with code 2: a refusal the worker has already printed as one line.
_REFUSED = re.compile(rb"^[EW]\d{4} [^\n]*torch/distributed/elastic/[^\n]*failed \(exitcode: 2\)", re.M)


_ANSI = re.compile(rb"\x1b\[[0-9;]*m")


def _pass_stderr(src: Any, dst: Any) -> bool:
    """Copy torchrun's stderr (its workers' too) to ``dst`` as it comes; from torchrun's report of a worker that
    exited 2 (a user's mistake, refused with one ``error:`` line) on, drop its failure report (a traceback and a
    table) but keep ``error:`` lines. True when that happened."""
    refused, rest = False, b""
    while chunk := os.read(src.fileno(), 1 << 16):
        if not refused and (m := _REFUSED.search(chunk)):
            dst.write(chunk[: m.start()])
            refused, chunk = True, chunk[m.start() :]
        if not refused:
            dst.write(chunk)
        else:
            *lines, rest = (rest + chunk).split(b"\n")
            dst.write(b"".join(line + b"\n" for line in lines if _ANSI.sub(b"", line).startswith(b"error:")))
        dst.flush()
    return refused


def launch_torchrun(argv: list[str], output: Path | None = None, **kw: Any) -> int:
    """Run torchrun in its own session and pass it the stop signals once (a signal to the whole process group
    would reach it twice). Returns its exit code; 2 when a worker refused the run (a user's mistake: its one-line
    error shown, torchrun's traceback not); :data:`primus.core.stop.PREEMPTED_EXIT` when the workers stopped early
    with a checkpoint (``output``'s summary says so)."""
    import json
    import signal
    import threading

    from primus.core.stop import PREEMPTED_EXIT

    cmd = torchrun_command(argv, **kw)
    log.info("launching: %s", shlex.join(cmd))
    env = {**TORCHRUN_ENV, **os.environ, LAUNCHED_ENV: "1"}
    if sys.stderr.isatty():  # the workers write through a pipe: keep rich's terminal output (progress bar)
        env.update({"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"})
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
    refused: list[bool] = []
    pump = threading.Thread(target=lambda: refused.append(_pass_stderr(proc.stderr, sys.stderr.buffer)), daemon=True)
    pump.start()
    forwarded = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    previous = {num: signal.signal(num, lambda num, _frame: proc.send_signal(num)) for num in forwarded}
    try:
        rc = proc.wait()
        pump.join()
    finally:
        for num, handler in previous.items():
            signal.signal(num, handler)
    if rc and refused and refused[0]:
        return 2
    if output is not None:  # a worker may leave with 0 after its early stop (torchrun then returns 0)
        summary = output / "summary.json"
        try:  # this launch's summary, not an earlier run's in the same folder
            fresh = summary.stat().st_mtime >= started
            status = json.loads(summary.read_text()).get("status") if fresh else None
        except (OSError, ValueError):
            status = None
        if status == "preempted":
            return PREEMPTED_EXIT
    return rc
