"""A run preempted and resumed in its folder (checkpoint.resume: auto, the requeued job) logs on to the same W&B and
MLflow runs, both loggers on at once: together they hold every metrics.jsonl row once."""

from __future__ import annotations

import time

import pytest
from loggers_support import jsonl_rows, same, wandb_runs

pytest.importorskip("mlflow")


def test_a_preempted_run_resumed_in_its_folder_logs_on_to_the_same_logger_runs(tmp_path, train):
    from mlflow.tracking import MlflowClient

    out, uri = tmp_path / "run", f"file:{tmp_path / 'mlruns'}"
    on = ["checkpoint.resume=auto", "logging.loggers.wandb.mode=offline", f"logging.loggers.mlflow.tracking_uri={uri}"]
    started = time.monotonic()
    first = train(out, *on, "backend.extra.signal_at=5")
    assert first["status"] == "preempted" and first["final_step"] == 5

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("primus").experiment_id])
    assert run.info.status == "KILLED" and run.data.tags["status"] == "preempted"

    time.sleep(max(0.0, started + 1.1 - time.monotonic()))  # W&B names an offline run's folder by its start second
    second = train(out, *on)  # the same command, requeued
    assert second["status"] == "ok" and second["start_step"] == 5
    rows = jsonl_rows(out)
    assert sorted(rows) == [3, 5, 6, 8]

    (resumed,) = client.search_runs([run.info.experiment_id])
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert resumed.data.tags["status"] == "ok"
    for key in rows[3]:
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert sorted(history) == sorted(rows), key
        assert all(same(history[step], row[key]) for step, row in rows.items()), key

    before, after = wandb_runs(out)
    assert before.id == after.id and (before.exit_code, after.exit_code) == (75, 0)
    assert before.summary["status"] == "preempted" and after.summary["status"] == "ok"
    history = {**before.history, **after.history}
    assert sorted(before.history) == [3, 5] and sorted(history) == sorted(rows)
    assert all(same(history[step][key], value) for step, row in rows.items() for key, value in row.items())
