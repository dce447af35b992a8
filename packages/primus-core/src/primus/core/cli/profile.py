"""``primus profile CONFIG``: train a few steps under torch.profiler, then write the step-time report (the launcher's
work: :func:`primus.core.launch.start.profile`); the report is printed here."""

from __future__ import annotations

from typing import Annotated

import typer


def profile(
    config: Annotated[str, typer.Argument(help="a YAML file or a preset name")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides")] = None,
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", help="processes (devices) per node")] = 1,
    master_port: Annotated[int, typer.Option(help="rendezvous port")] = 29500,
) -> None:
    """Runs ``primus train`` with profiling on (checkpoints off), then analyzes the traces it wrote."""
    from rich.markdown import Markdown

    from primus.core.cli.helpers import err, fail, out, setup_logging
    from primus.core.contracts.errors import UserError
    from primus.core.launch.start import profile as start_profile

    setup_logging()
    try:
        code, report, folder = start_profile(config, overrides or [], nproc_per_node, master_port, console=err)
    except UserError as exc:
        raise fail(exc, getattr(exc, "exit_code", 2)) from None
    if report is None or folder is None:
        raise typer.Exit(code)
    out.print(Markdown(report))
    out.print(f"wrote {folder / 'report.md'} and {folder / 'report.html'}", highlight=False)
