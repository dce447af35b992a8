"""One run: resolve and validate the config, select kernels, hand over to the backend on each rank.

``launch`` runs in the user's process: one device trains in process; more devices re-run ``primus
train`` under ``torch.distributed.run`` (torchrun), one process per device.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
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


def run_rank(res: Resolved, resume: bool = False) -> dict[str, Any]:
    """Train on this rank (called once per process)."""
    from primus.core.data.checks import check_data

    check_data(res.config)  # every data refusal comes before anything is written (the run folder included)

    from primus.core.kernels import detect_device, select_kernels
    from primus.core.metrics import peak_flops
    from primus.core.modelmath import count_params, flops_per_token

    cfg, registry = res.config, res.registry
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = detect_device()
    device_name = None
    if device != "cpu":
        from primus.core.planner.auto import check_fits

        check_fits(cfg, res.world_size, registry=registry)  # a layout that cannot fit: refused before any build
        import torch

        device_name = torch.cuda.get_device_name(local_rank)
    kernels = select_kernels(cfg.kernels, registry, device, head_dim=cfg.model.kv_channels, dtype=cfg.train.precision)
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
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        log.info("kernels: %s", ", ".join(f"{op}={name}" for op, name in info.kernels.items()))
    hooks = registry.pm.hook
    ctx = RunContext(info=info, hooks=hooks, kernels=kernels, resume=resume or cfg.checkpoint.resume, config=cfg)
    backend = registry.backends[cfg.backend.name]
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


def launch_torchrun(argv: list[str], **kw: Any) -> int:
    cmd = torchrun_command(argv, **kw)
    log.info("launching: %s", shlex.join(cmd))
    env = dict(os.environ, **{LAUNCHED_ENV: "1"})
    return subprocess.call(cmd, env=env)
