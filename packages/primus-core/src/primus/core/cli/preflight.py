"""``primus preflight``: devices and versions, GEMM and memory rates against the datasheet, collectives."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer


def preflight(
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", help="ranks (one per device) to test")] = 1,
    gemm_size: Annotated[int | None, typer.Option(help="square GEMM size [default: 8192 on GPUs, 1024 on CPU]")] = None,
    copy_mib: Annotated[
        int | None, typer.Option(help="MiB copied for the bandwidth check [default: 1024 on GPUs, 64 on CPU]")
    ] = None,
    comm_mib: Annotated[int | None, typer.Option(help="MiB per collective [default: 256 on GPUs, 16 on CPU]")] = None,
    iters: Annotated[int | None, typer.Option(help="timed repetitions [default: 10 on GPUs, 3 on CPU]")] = None,
) -> None:
    """Check this machine: GEMM and memory rates against the datasheet, collectives across ranks. Exit 0 when every
    check on every rank passes, 1 otherwise."""
    from rich.table import Table

    from primus.core.cli.helpers import out
    from primus.core.launch.launcher import LAUNCHED_ENV, launch_torchrun
    from primus.core.launch.preflight import run, versions

    if nproc_per_node > 1 and not (os.environ.get(LAUNCHED_ENV) or "LOCAL_RANK" in os.environ):
        argv = sys.argv[1:]
        raise typer.Exit(launch_torchrun(argv, nproc_per_node=nproc_per_node))
    import torch

    from primus.core.cli.helpers import err

    gpu = torch.cuda.is_available()  # a CPU is checked at CPU sizes: the GPU sizes take many minutes there
    sizes = dict(
        gemm_size=gemm_size or (8192 if gpu else 1024),
        copy_mib=copy_mib or (1024 if gpu else 64),
        comm_mib=comm_mib or (256 if gpu else 16),
        iters=iters or (10 if gpu else 3),
    )
    if int(os.environ.get("RANK", "0")) == 0:
        err.print(
            f"preflight on {'GPU' if gpu else 'CPU'}: GEMM {sizes['gemm_size']}², copy {sizes['copy_mib']} MiB, "
            f"collectives {sizes['comm_mib']} MiB, {sizes['iters']} repetitions each ...",
            highlight=False,
        )
    results = run(**sizes)
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
