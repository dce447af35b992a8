"""``primus train CONFIG``: resolve + validate a config, then run it (under torchrun when more than one process).

Importing this module imports neither torch nor an engine: the work is imported when the command runs."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Annotated

import typer

from primus.core.cli.helpers import Overrides, err, fail, resolve_or_exit, setup_logging


def train(
    config: Annotated[str, typer.Argument(help="a YAML file or a preset name (primus presets list)")],
    overrides: Overrides = None,
    resume: Annotated[bool, typer.Option(help="continue from the newest complete checkpoint")] = False,
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", min=1, help="processes (devices) per node")] = 1,
    nnodes: Annotated[int, typer.Option(min=1, help="nodes")] = 1,
    node_rank: Annotated[int, typer.Option(min=0, help="this node's rank")] = 0,
    master_addr: Annotated[str, typer.Option(help="rendezvous host")] = "127.0.0.1",
    master_port: Annotated[int, typer.Option(help="rendezvous port")] = 29500,
    rdzv: Annotated[
        str | None, typer.Option(help="HOST:PORT of a c10d rendezvous (elastic; replaces master-*)")
    ] = None,
) -> None:
    """Train: resolve + validate the config, then run it on the backend named by backend.name."""
    from primus.core.run import stop

    with stop.listen_early():  # a stop signal while the run starts stops it after its first step, with a checkpoint
        _train(config, overrides, resume, nproc_per_node, nnodes, node_rank, master_addr, master_port, rdzv)


def _train(
    config: str,
    overrides: list[str] | None,
    resume: bool,
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    rdzv: str | None,
) -> None:
    from primus.core.launch.launcher import LAUNCHED_ENV, launch_torchrun
    from primus.core.launch.train import run_rank
    from primus.core.run import stop

    setup_logging()
    world = nproc_per_node * nnodes
    inside = os.environ.get(LAUNCHED_ENV) or "LOCAL_RANK" in os.environ
    res = resolve_or_exit(config, overrides, None if inside else world)  # refuse bad configs before launching
    from primus.core.contracts.errors import UserError
    from primus.core.run.rundir import LOCK_HELD_ENV, check_free, output_dir

    try:
        with _one_line_if_full(res.config):
            if not inside:
                from primus.core.data.checks import check_data
                from primus.core.launch.run_checks import check_folders, check_plugins, resume_warning
                from primus.core.launch.train import check_output_dir, claim_output_dir

                check_folders(res.config)  # a file, or no write permission, where the run folder goes
                check_free(output_dir(res.config))  # another run writes there: name it (creates nothing)
                check_output_dir(res.config, resume)
                check_plugins(res.config, res.registry)  # what a plugin cannot do here (GEMM tuning on a CPU)
                # the first line of a run the launcher's checks accepted (a refused one prints only its error),
                # before the engine's imports and build (seconds to a minute); a rank's own refusals (data, kernels
                # on this device) follow it, still before anything is written
                c = res.config
                err.print(
                    f"train {config}: {c.model.name} on {c.backend.name}, {world} process{'es' if world > 1 else ''}, "
                    f"{c.train.steps} steps -> {output_dir(c)}",
                    highlight=False,
                    markup=False,
                )
                for note in res.layers.notes:  # a value the loader changed (a warmup longer than train.steps)
                    err.print(f"note: {note}", highlight=False, markup=False)
                if world > 1:
                    check_data(res.config)  # once, before the ranks start (each rank's run_rank checks it too)
                if (resume or res.config.checkpoint.resume is True) and (warning := resume_warning(res.config)):
                    err.print(f"warning: {warning}", style="yellow", highlight=False, markup=False)
            if world > 1 and not inside:
                if reason := stop.pending():
                    err.print(f"stopped by {reason} before the run started", style="yellow", highlight=False)
                    raise typer.Exit(stop.PREEMPTED_EXIT)
                # one node: this process holds the output folder's lock for the whole job (torchrun inherits it);
                # several: each node has a launcher, and global rank 0 takes it
                existed = output_dir(res.config).exists()
                fd = claim_output_dir(res.config, resume) if nnodes == 1 else None
                if fd is not None:
                    os.environ[LOCK_HELD_ENV] = "1"
                argv = ["train", config, *(overrides or [])] + (["--resume"] if resume else [])
                rc = launch_torchrun(
                    argv,
                    output=output_dir(res.config),
                    keep_fd=fd,
                    nproc_per_node=nproc_per_node,
                    nnodes=nnodes,
                    node_rank=node_rank,
                    master_addr=master_addr,
                    master_port=master_port,
                    rdzv=rdzv,
                )
                if not existed:  # a run refused on its ranks writes nothing: only this launcher's lock is there
                    _drop_if_only_lock(output_dir(res.config))
                raise typer.Exit(rc)
            from primus.core.launch.run_checks import fp8_warning

            if int(os.environ.get("RANK", "0")) == 0 and (warning := fp8_warning(res.config)):
                err.print(f"warning: {warning}", style="yellow", highlight=False, markup=False)
            summary = run_rank(res, resume=resume)
    except UserError as exc:
        raise fail(exc, getattr(exc, "exit_code", 2)) from None
    if int(os.environ.get("RANK", "0")) == 0:
        err.print(f"done: {json.dumps(summary, default=str)}", highlight=False)
    if summary.get("status") == "preempted":  # checkpoint committed; the same command continues the run
        raise typer.Exit(stop.PREEMPTED_EXIT)


@contextlib.contextmanager
def _one_line_if_full(cfg):
    """A write that failed on a full file system (the run folder, the checkpoints, the data cache, the temporary
    folder) becomes :class:`primus.core.run.rundir.NoSpaceLeft`: one line naming the device and the path."""
    try:
        yield
    except (typer.Exit, KeyboardInterrupt, SystemExit):  # (click's Exit is a RuntimeError)
        raise
    except BaseException as exc:  # (torch's CheckpointException is a BaseException)
        import tempfile

        from primus.core.data.cache import cache_root
        from primus.core.run.rundir import checkpoint_root, no_space, output_dir

        folders = [output_dir(cfg), checkpoint_root(cfg), cache_root(), Path(tempfile.gettempdir())]
        if (full := no_space(exc, folders)) is not None:
            raise full from None
        raise


def _drop_if_only_lock(out) -> None:
    from primus.core.run.rundir import LOCK_NAME

    if out.is_dir() and [p.name for p in out.iterdir()] == [LOCK_NAME]:
        (out / LOCK_NAME).unlink()
        out.rmdir()
