"""Weights & Biases logging, the entry point ``wandb``: off unless ``logging.loggers.wandb`` is set; rank 0 only.

    logging:
      loggers:
        wandb: {project: my-project, mode: offline}   # settings: primus.loggers.common.WandbSettings

``primus_on_train_start`` starts a W&B run in the run folder (``<output_dir>/wandb``) with the resolved config;
``primus_on_log`` logs the numbers of each ``metrics.jsonl`` row at its step; ``primus_on_train_end`` records the
summary's status and finishes the run with the process's exit code (0 ok, 75 preempted, 1 failed). A run resumed in
the same folder logs on to the same W&B run. ``wandb`` is imported inside the hooks, only when the logger is on.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from primus.core import hookimpl

NAME = "wandb"
log = logging.getLogger("primus.loggers.wandb")

# this process's W&B run (one training run per process), between train_start and train_end
_active: dict[str, Any] = {}


@hookimpl
def primus_configure(config: dict[str, Any]) -> None:
    """Refuse bad ``logging.loggers.wandb`` settings, or the logger without wandb installed, naming the key."""
    from primus.loggers.common import WandbSettings, check

    check(NAME, config, WandbSettings, library="wandb")


@hookimpl
def primus_on_train_start(config: Any, info: Any) -> None:
    from primus.loggers.common import Guard, WandbSettings, save_run_id, saved_run_id, settings_of

    settings = settings_of(config, NAME, WandbSettings)
    if settings is None or info.rank != 0:
        return
    import wandb

    out = Path(info.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_id = saved_run_id(info, NAME)
    run = wandb.init(
        project=settings.project,
        entity=settings.entity,
        name=settings.name or out.name,
        group=settings.group,
        tags=settings.tags or None,
        mode=settings.mode,
        dir=str(out),
        config=config.model_dump(mode="json"),
        id=run_id,
        resume="allow" if run_id else None,
        reinit="create_new",  # this run only: a W&B run the calling program has open stays as it is
    )
    save_run_id(info, NAME, run.id)
    log.info("wandb: run %s%s", run.id, f" ({run.url})" if run.url else f" in {run.dir}")
    _active.update(run=run, guard=Guard(NAME))


@hookimpl
def primus_on_log(step: int, metrics: dict[str, float], info: Any) -> None:
    run = _active.get("run")
    if run is None:
        return
    from primus.loggers.common import numeric

    with _active["guard"]:
        run.log(numeric(metrics), step=step)


@hookimpl
def primus_on_train_end(summary: dict[str, Any], info: Any) -> None:
    run, guard = _active.pop("run", None), _active.pop("guard", None)
    if run is None:
        return
    from primus.core.run.stop import PREEMPTED_EXIT

    status = summary.get("status", "failed")
    with guard:
        run.summary.update({k: summary[k] for k in ("status", "final_step", "stop_reason", "error") if k in summary})
        if status == "preempted":
            run.mark_preempting()
    with guard:  # finished even when the summary could not be written
        run.finish(exit_code={"ok": 0, "preempted": PREEMPTED_EXIT}.get(status, 1))
    guard.report()
