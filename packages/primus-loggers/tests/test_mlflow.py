"""MLflow file store: a real core run (stand-in engine) logs the resolved config as params, every metric of
metrics.jsonl at its step, and ends the run with its status; a failed run ends FAILED. Read back with MlflowClient."""

from __future__ import annotations

import json

import pytest
import yaml
from loggers_support import jsonl_rows, same

from primus.loggers.common import flatten

mlflow = pytest.importorskip("mlflow")


def only_run(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def test_a_file_store_run_records_the_config_every_metric_and_the_status(tmp_path, train):
    out, uri = tmp_path / "run", f"file:{tmp_path / 'mlruns'}"
    on = [f"logging.loggers.mlflow.tracking_uri={uri}", "logging.loggers.mlflow.experiment=primus-test"]
    summary = train(out, *on, "eval.holdout=0.1", "eval.interval=4")
    assert summary["status"] == "ok"
    rows = jsonl_rows(out)
    assert sorted(rows) == [3, 4, 6, 8] and "eval_loss" in rows[4] and "eval_loss" not in rows[6]

    client, run = only_run(uri, "primus-test")
    run_id = run.info.run_id
    logged = {key: client.get_metric_history(run_id, key) for key in run.data.metrics}
    assert logged.keys() == {key for row in rows.values() for key in row}
    for key, history in logged.items():
        expected = {step: row[key] for step, row in rows.items() if key in row}
        assert sorted(m.step for m in history) == sorted(expected), key
        assert all(same(m.value, expected[m.step]) for m in history), key
    config = yaml.safe_load((out / "config.yaml").read_text())  # the resolved config, as the run wrote it
    assert run.data.params == {key: str(value) for key, value in flatten(config).items()}
    assert run.data.params["train.steps"] == "8" and run.data.params["logging.loggers.mlflow.tracking_uri"] == uri
    assert run.info.status == "FINISHED" and run.info.run_name == "run"  # the name defaults to the run folder's
    assert run.data.tags["status"] == "ok" and run.data.tags["final_step"] == "8"
    assert run.data.tags["primus.output_dir"] == str(out)
    assert json.loads((out / "loggers" / "mlflow.json").read_text()) == {"run_id": run_id}


def test_a_failed_run_ends_its_mlflow_run_failed(tmp_path, train):
    out, uri = tmp_path / "run", f"file:{tmp_path / 'mlruns'}"
    with pytest.raises(RuntimeError, match="engine failed at step 5"):
        train(out, f"logging.loggers.mlflow.tracking_uri={uri}", "backend.extra.fail_at=5")
    client, run = only_run(uri, "primus")  # the default experiment
    assert run.info.status == "FAILED" and run.data.tags["status"] == "failed"
    assert "engine failed at step 5" in run.data.tags["error"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == sorted(jsonl_rows(out)) == [3]
