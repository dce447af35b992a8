"""``primus slurm script|submit``: write (and submit) an sbatch script for a config."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Annotated

import typer

slurm_app = typer.Typer(help="Run on a Slurm cluster: srun + torchrun per node.", no_args_is_help=True)

Config = Annotated[str, typer.Argument(help="a YAML file or a preset name")]
Overrides = Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides")]
Nodes = Annotated[int, typer.Option(help="nodes")]
Gpus = Annotated[int, typer.Option("--gpus-per-node", help="GPUs (processes) per node")]
Family = Annotated[str, typer.Option(help="nvidia or amd: which launch environment defaults to use")]
Env = Annotated[list[str] | None, typer.Option("--env", help="KEY=VALUE exported in the job (repeatable)")]
Partition = Annotated[str | None, typer.Option(help="Slurm partition")]
Account = Annotated[str | None, typer.Option(help="Slurm account")]
Time = Annotated[str, typer.Option(help="wall-clock limit")]
Out = Annotated[Path | None, typer.Option("--out", help="where the script is written (default <output_dir>/sbatch.sh)")]


def _job(config, overrides, nodes, gpus_per_node, family, env, partition, account, time):
    from primus.core.cli.helpers import resolve_or_exit
    from primus.core.launch.slurm import SlurmJob
    from primus.core.run.rundir import output_dir

    res = resolve_or_exit(config, overrides, nodes * gpus_per_node)  # refuse a bad config before anything is queued
    path = Path(config)
    cfg_ref = str(path.resolve()) if path.is_file() else config  # compute nodes see the shared file system
    pairs = dict(item.split("=", 1) for item in (env or []) if "=" in item)
    out = output_dir(res.config).resolve()
    job = SlurmJob(
        cfg_ref,
        overrides or [],
        nodes,
        gpus_per_node,
        family,
        f"primus-{res.config.model.name}",
        time,
        partition,
        account,
        output_dir=str(out),
        env=pairs,
    )
    return job, out


def _command(submit: bool):
    """One callback for both commands (same options); ``submit`` also hands the script to sbatch."""

    def command(
        config: Config,
        overrides: Overrides = None,
        nodes: Nodes = 1,
        gpus_per_node: Gpus = 8,
        family: Family = "nvidia",
        env: Env = None,
        partition: Partition = None,
        account: Account = None,
        time: Time = "24:00:00",
        out: Out = None,
    ) -> None:
        from primus.core.cli.helpers import err
        from primus.core.cli.helpers import out as console
        from primus.core.launch.slurm import script, write

        if submit and shutil.which("sbatch") is None:
            err.print(
                "error: sbatch not found on PATH: run on a Slurm login node, or use `primus slurm script`",
                style="red",
                markup=False,
            )
            raise typer.Exit(2)
        job, run_dir = _job(config, overrides, nodes, gpus_per_node, family, env, partition, account, time)
        path = write(job, out or run_dir / "sbatch.sh")
        if not submit:
            console.print(script(job), highlight=False, markup=False)
            console.print(f"# written to {path}", highlight=False, markup=False)
            return
        result = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
        if result.returncode:
            err.print(f"error: sbatch failed: {result.stderr.strip()}", style="red", markup=False)
            raise typer.Exit(result.returncode)
        console.print(f"{result.stdout.strip()} ({path})", highlight=False, markup=False)

    command.__doc__ = "Write the sbatch script and submit it with sbatch." if submit else "Write the sbatch script."
    return command


slurm_app.command("script")(_command(submit=False))
slurm_app.command("submit")(_command(submit=True))
