"""MLflow logging, the entry point ``mlflow``: off unless ``logging.loggers.mlflow`` is set; rank 0 only.

    logging:
      loggers:
        mlflow: {tracking_uri: http://mlflow:5000, experiment: llama}   # settings: primus.loggers.common.MlflowSettings

``primus_on_train_start`` starts an MLflow run in the experiment (created when missing) and logs the resolved config
as params, flattened to dotted keys (``train.optimizer.lr``); ``primus_on_log`` logs the numbers of each
``metrics.jsonl`` row at its step; ``primus_on_train_end`` tags the summary's status and ends the run FINISHED, KILLED
(preempted) or FAILED. A run resumed in the same folder logs on to the same MLflow run. It talks to the tracking
store through an ``MlflowClient`` of its own (no global MLflow state is changed), imported inside the hooks.

A ``file:`` tracking URI is MLflow's file store, which MLflow 3 refuses unless ``MLFLOW_ALLOW_FILE_STORE`` is set: a
config that names one asks for it, so this logger sets ``MLFLOW_ALLOW_FILE_STORE=true`` where it is not set.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from primus.core import hookimpl

NAME = "mlflow"
log = logging.getLogger("primus.loggers.mlflow")

# this process's MLflow run (one training run per process), between train_start and train_end
_active: dict[str, Any] = {}

END_STATUS = {"ok": "FINISHED", "preempted": "KILLED"}  # anything else: FAILED


@hookimpl
def primus_configure(config: dict[str, Any]) -> None:
    """Refuse bad ``logging.loggers.mlflow`` settings, or the logger without MLflow installed, naming the key."""
    from primus.loggers.common import MlflowSettings, check

    check(NAME, config, MlflowSettings, library="mlflow")


@hookimpl
def primus_on_train_start(config: Any, info: Any) -> None:
    from primus.loggers.common import Guard, MlflowSettings, flatten, save_run_id, saved_run_id, settings_of

    settings = settings_of(config, NAME, MlflowSettings)
    if settings is None or info.rank != 0:
        return
    if (settings.tracking_uri or "").startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings.tracking_uri)
    run = _resumed(client, saved_run_id(info, NAME)) or _new_run(client, settings, info)
    run_id = run.info.run_id
    save_run_id(info, NAME, run_id)
    params = {key: str(value) for key, value in flatten(config.model_dump(mode="json")).items()}
    logged = run.data.params  # a resumed run has them: MLflow params never change
    changed = sorted(key for key, value in params.items() if key in logged and logged[key] != value)
    if changed:
        log.warning("mlflow: run %s keeps its first values of %s", run_id, ", ".join(changed))
    client.log_batch(run_id, params=[Param(key, value) for key, value in params.items() if key not in logged])
    log.info("mlflow: run %s in experiment %r (%s)", run_id, settings.experiment, client.tracking_uri)
    _active.update(client=client, run_id=run_id, guard=Guard(NAME))


def _resumed(client: Any, run_id: str | None) -> Any:
    """The MLflow run an earlier start in this run folder logged to, set running again; None if there is none."""
    if run_id is None:
        return None
    from mlflow.exceptions import MlflowException

    try:
        client.update_run(run_id, status="RUNNING")
        return client.get_run(run_id)
    except MlflowException as exc:  # another tracking store, or the run was deleted
        log.warning("mlflow: cannot continue run %s (%s); starting a new one", run_id, exc)
        return None


def _new_run(client: Any, settings: Any, info: Any) -> Any:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(settings.experiment)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:
        try:
            experiment_id = client.create_experiment(settings.experiment)
        except MlflowException:  # created meanwhile by another job
            experiment_id = client.get_experiment_by_name(settings.experiment).experiment_id
    out = Path(info.output_dir)
    tags = {"primus.output_dir": str(out.absolute()), **settings.tags}
    return client.create_run(experiment_id, run_name=settings.run_name or out.name, tags=tags)


@hookimpl
def primus_on_log(step: int, metrics: dict[str, float], info: Any) -> None:
    client = _active.get("client")
    if client is None:
        return
    from mlflow.entities import Metric

    from primus.loggers.common import numeric

    now = int(time.time() * 1000)
    with _active["guard"]:
        rows = [Metric(key, float(value), now, step) for key, value in numeric(metrics).items()]
        client.log_batch(_active["run_id"], metrics=rows)


@hookimpl
def primus_on_train_end(summary: dict[str, Any], info: Any) -> None:
    client = _active.pop("client", None)
    run_id, guard = _active.pop("run_id", None), _active.pop("guard", None)
    if client is None:
        return
    from mlflow.entities import RunTag

    status = summary.get("status", "failed")
    with guard:
        facts = {k: str(summary[k])[:5000] for k in ("status", "final_step", "stop_reason", "error") if k in summary}
        client.log_batch(run_id, tags=[RunTag(key, value) for key, value in facts.items()])
    with guard:  # ended even when the tags could not be written
        client.set_terminated(run_id, status=END_STATUS.get(status, "FAILED"))
    guard.report()
