"""``primus preflight``: devices and versions, GEMM and memory rates against the datasheet, collectives."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer


def preflight(
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", help="ranks (one per device) to test")] = 1,
    gemm_size: Annotated[int, typer.Option(help="square GEMM size")] = 8192,
    copy_mib: Annotated[int, typer.Option(help="MiB copied for the bandwidth check")] = 1024,
    comm_mib: Annotated[int, typer.Option(help="MiB per collective")] = 256,
    iters: Annotated[int, typer.Option(help="timed repetitions")] = 10,
) -> None:
    """Exit 0 when every check on every rank passes, 1 otherwise."""
    from rich.table import Table

    from primus.core.cli.helpers import out
    from primus.core.launch.preflight import run, versions
    from primus.core.launch.train import LAUNCHED_ENV, launch_torchrun

    if nproc_per_node > 1 and not (os.environ.get(LAUNCHED_ENV) or "LOCAL_RANK" in os.environ):
        argv = sys.argv[1:]
        raise typer.Exit(launch_torchrun(argv, nproc_per_node=nproc_per_node))
    results = run(gemm_size=gemm_size, copy_mib=copy_mib, comm_mib=comm_mib, iters=iters)
    if int(os.environ.get("RANK", "0")) != 0:
        raise typer.Exit(0 if all(r.ok for r in results) else 1)
    out.print("  ".join(f"{k} {v}" for k, v in versions().items()), highlight=False)
    table = Table("rank", "device", "check", "result", "datasheet", "verdict", box=None)
    for r in results:
        for c in r.checks:
            table.add_row(
                str(r.rank),
                r.device,
                c.name,
                f"{c.value:,.4g} {c.unit}",
                f"{c.peak:,.0f}" if c.peak else "-",
                ("PASS" if c.ok else "FAIL") + (f" {c.note}" if c.note else ""),
            )
    out.print(table)
    ok = all(r.ok for r in results)
    out.print("preflight: PASS" if ok else "preflight: FAIL", style="green" if ok else "red")
    raise typer.Exit(0 if ok else 1)
