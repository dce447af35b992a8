"""W&B offline: a real core run (stand-in engine) logs the resolved config, every metric of metrics.jsonl at its step
and the final status; a failed run still finishes its W&B run. Read back from the offline run's own file."""

from __future__ import annotations

import json

import pytest
import yaml
from loggers_support import jsonl_rows, same, wandb_runs


def test_an_offline_run_records_the_config_every_metric_and_the_status(tmp_path, train):
    out = tmp_path / "run"
    summary = train(out, "logging.loggers.wandb.project=primus-test", "eval.holdout=0.1", "eval.interval=4")
    assert summary["status"] == "ok"
    rows = jsonl_rows(out)
    assert sorted(rows) == [3, 4, 6, 8] and "eval_loss" in rows[4] and "eval_loss" not in rows[6]

    (run,) = wandb_runs(out)  # offline (WANDB_MODE), in the run folder
    assert (run.project, run.name) == ("primus-test", "run")  # the name defaults to the run folder's
    assert sorted(run.history) == sorted(rows)
    for step, row in rows.items():
        assert run.history[step].keys() == row.keys(), step
        assert all(same(run.history[step][key], value) for key, value in row.items()), (step, run.history[step])
    config = {key: value for key, value in run.config.items() if key != "_wandb"}
    assert config == yaml.safe_load((out / "config.yaml").read_text())  # the resolved config, as the run wrote it
    assert config["train"]["steps"] == 8 and config["logging"]["loggers"] == {"wandb": {"project": "primus-test"}}
    assert run.summary["status"] == "ok" and run.summary["final_step"] == 8 and run.exit_code == 0
    assert json.loads((out / "loggers" / "wandb.json").read_text()) == {"run_id": run.id}


def test_a_failed_run_finishes_its_wandb_run_failed(tmp_path, train):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="engine failed at step 5"):
        train(out, "logging.loggers.wandb.mode=offline", "backend.extra.fail_at=5")
    (run,) = wandb_runs(out)
    assert sorted(run.history) == sorted(jsonl_rows(out)) == [3]
    assert run.summary["status"] == "failed" and "engine failed at step 5" in run.summary["error"]
    assert run.exit_code == 1
