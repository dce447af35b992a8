"""``primus eval RUN_FOLDER`` or ``primus eval CONFIG --checkpoint CKPT``: the evaluation loss of a checkpoint alone
(under torchrun when more than one process). The evaluation data is the config's (``eval.holdout`` as in training, or
``eval.source``); a run folder gives its own ``config.yaml`` and ``checkpoints/`` (the newest). The launcher does the
work (:func:`primus.core.launch.start.evaluate`).

Importing this module imports neither torch nor an engine: the work is imported when the command runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from primus.core.cli.helpers import Overrides, fail, out, setup_logging


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
    from primus.core.launch.start import evaluate as start_eval

    setup_logging("warning")
    try:
        code = start_eval(config, overrides or [], checkpoint, nproc_per_node, output, console=out)
    except UserError as exc:
        raise fail(exc, getattr(exc, "exit_code", 2)) from None
    raise typer.Exit(code)
