"""``primus train CONFIG``: its arguments; the launcher does the rest (:func:`primus.core.launch.start.start`).

Importing this module imports neither torch nor an engine: the work is imported when the command runs."""

from __future__ import annotations

from typing import Annotated

import typer

from primus.core.cli.helpers import Overrides, err, fail, setup_logging


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
    from primus.core.contracts.errors import UserError
    from primus.core.launch.start import Topology, start

    setup_logging()
    topology = Topology(nproc_per_node, nnodes, node_rank, master_addr, master_port, rdzv)
    try:
        code = start(config, overrides or [], resume, topology, console=err)
    except UserError as exc:
        raise fail(exc, getattr(exc, "exit_code", 2)) from None
    raise typer.Exit(code)
