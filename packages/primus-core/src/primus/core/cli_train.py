"""``primus train CONFIG``: resolve + validate a config, then run it (under torchrun when more than one process).

Importing this module imports neither torch nor an engine: the work is imported when the command runs."""

from __future__ import annotations

import json
import os
from typing import Annotated

import typer

from primus.core.cli_helpers import Overrides, _fail, _resolve, _setup_logging, err


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
    from primus.core.train import LAUNCHED_ENV, launch_torchrun, run_rank

    _setup_logging()
    world = nproc_per_node * nnodes
    inside = os.environ.get(LAUNCHED_ENV) or "LOCAL_RANK" in os.environ
    res = _resolve(config, overrides, None if inside else world)  # refuse bad configs before launching
    if not inside:
        from primus.core.data.checks import check_data
        from primus.core.errors import UserError
        from primus.core.run_checks import check_folders, resume_warning
        from primus.core.train import check_output_dir

        try:
            check_folders(res.config)  # a file, or no write permission, where the run folder goes
            check_output_dir(res.config, resume)
            if world > 1:
                check_data(res.config)  # once, before the ranks start (each rank's run_rank checks it too)
        except UserError as exc:
            raise _fail(exc) from None
        if (resume or res.config.checkpoint.resume is True) and (warning := resume_warning(res.config)):
            err.print(f"warning: {warning}", style="yellow", highlight=False, markup=False)
    if world > 1 and not inside:
        argv = ["train", config, *(overrides or [])] + (["--resume"] if resume else [])
        from primus.core.rundir import output_dir

        raise typer.Exit(
            launch_torchrun(
                argv,
                output=output_dir(res.config),
                nproc_per_node=nproc_per_node,
                nnodes=nnodes,
                node_rank=node_rank,
                master_addr=master_addr,
                master_port=master_port,
                rdzv=rdzv,
            )
        )
    from primus.core.errors import UserError
    from primus.core.run_checks import fp8_warning

    if int(os.environ.get("RANK", "0")) == 0 and (warning := fp8_warning(res.config)):
        err.print(f"warning: {warning}", style="yellow", highlight=False, markup=False)
    try:
        summary = run_rank(res, resume=resume)
    except UserError as exc:
        raise _fail(exc) from None
    if int(os.environ.get("RANK", "0")) == 0:
        err.print(f"done: {json.dumps(summary, default=str)}", highlight=False)
    if summary.get("status") == "preempted":  # checkpoint committed; the same command continues the run
        from primus.core.stop import PREEMPTED_EXIT

        raise typer.Exit(PREEMPTED_EXIT)
