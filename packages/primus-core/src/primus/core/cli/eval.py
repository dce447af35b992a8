"""``primus eval RUN_FOLDER`` or ``primus eval CONFIG --checkpoint CKPT``: the evaluation loss of a checkpoint alone
(under torchrun when more than one process). The evaluation data is the config's (``eval.holdout`` as in training, or
``eval.source``); a run folder gives its own ``config.yaml`` and ``checkpoints/`` (the newest).

Importing this module imports neither torch nor an engine: the work is imported when the command runs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from primus.core.cli.helpers import Overrides, fail, out, resolve_or_exit, setup_logging


def evaluate(
    config: Annotated[
        str, typer.Argument(help="a run folder (its config.yaml and checkpoints), or a YAML file or preset name")
    ],
    overrides: Overrides = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            help="a checkpoint folder (step_NNNNNNNN), or a checkpoint root: its newest [default: the run folder's "
            "checkpoints; required with a YAML file or preset]"
        ),
    ] = None,
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", min=1, help="processes (devices)")] = 1,
    output: Annotated[Path | None, typer.Option(help="also write the result to this JSON file")] = None,
) -> None:
    """Evaluate a checkpoint: eval_loss and eval_perplexity over eval.batches global batches (one JSON line)."""
    from primus.core.contracts.errors import UserError
    from primus.core.launch.launcher import LAUNCHED_ENV, launch_torchrun
    from primus.core.launch.rank import eval_rank

    setup_logging("warning")
    config, checkpoint = run_folder(config, checkpoint)
    inside = os.environ.get(LAUNCHED_ENV) or "LOCAL_RANK" in os.environ
    res = resolve_or_exit(config, overrides, None if inside else nproc_per_node)
    if not checkpoint.exists():
        raise fail(UserError(f"--checkpoint {checkpoint}: no such folder"))
    if nproc_per_node > 1 and not inside:
        argv = ["eval", config, *(overrides or []), "--checkpoint", str(checkpoint)]
        argv += ["--output", str(output)] if output else []
        from primus.core.launch.env import free_port

        raise typer.Exit(launch_torchrun(argv, nproc_per_node=nproc_per_node, master_port=free_port()))
    try:
        result = eval_rank(res, checkpoint)
    except UserError as exc:
        raise fail(exc) from None
    if int(os.environ.get("RANK", "0")) == 0:
        line = json.dumps(result)
        out.print(line, highlight=False, markup=False, soft_wrap=True)
        if output:
            output.write_text(line + "\n")


def run_folder(config: str, checkpoint: Path | None) -> tuple[str, Path]:
    """A run folder stands for its ``config.yaml`` (what it trained) and, unless ``--checkpoint`` is given, its
    ``checkpoints/``; a YAML file or preset needs ``--checkpoint``."""
    from primus.core.contracts.errors import UserError

    folder = Path(config)
    if folder.is_dir():
        if not (folder / "config.yaml").is_file():
            raise fail(UserError(f"{config}: a folder without config.yaml, so not a run folder"))
        return str(folder / "config.yaml"), checkpoint or folder / "checkpoints"
    if checkpoint is None:
        raise fail(UserError(f"--checkpoint is needed with {config!r} (a run folder names its own checkpoints)"))
    return config, checkpoint
