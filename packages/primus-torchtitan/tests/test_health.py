"""Training health (train.health) on the real trainer: a NaN injected into step 3's loss (drive.py: a
real NaN through the backward pass into the gradients and grad norm) stops the run at that step, or is
skipped (no update, no LR step) while the run goes on; and the collective timeout reaches torchtitan."""

from __future__ import annotations

import math

import pytest
from conftest import TINY, drive, metrics, summary

from primus.core.config.schema import PrimusConfig
from primus.torchtitan import job_config

NAN_AT_3 = {"PRIMUS_TEST_NAN_AT": "3"}


def test_nonfinite_loss_stops_the_run_at_that_step(tmp_path):
    proc = drive(
        TINY, tmp_path, "train.steps=6", "checkpoint.interval=2", "checkpoint.keep_last=5", env=NAN_AT_3, check=False
    )
    assert proc.returncode != 0
    assert "error: step 3: non-finite loss and grad norm" in proc.stderr, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]  # step 3 was neither applied nor reported
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "step_00000002" / ".metadata").is_file()  # the last good checkpoint is kept
    assert not (ckpts / "step_00000003").exists() and not (ckpts / "step_00000004").exists()


def test_skip_drops_the_update_and_continues(tmp_path):
    proc = drive(
        TINY, tmp_path, "train.steps=5", "checkpoint.enabled=false", "train.health.on_nonfinite=skip", env=NAN_AT_3
    )
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 6))
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1]
    assert all(r["loss_spikes"] == 0 for r in rows)
    assert math.isnan(rows[2]["loss"])
    # the skipped step changed no weight: step 4 trains on finite weights, and the LR schedule (which
    # counts applied updates) did not advance, so step 4 runs at step 3's LR
    assert all(math.isfinite(r["loss"]) for r in rows[3:])
    assert rows[3]["lr"] == rows[2]["lr"] and rows[2]["lr"] != rows[1]["lr"]
    assert rows[-1]["loss"] < rows[0]["loss"]
    done = summary(proc)
    assert done["status"] == "ok" and done["skipped_steps"] == 1 and done["final_step"] == 5


def test_collective_timeout_reaches_torchtitans_process_groups():
    cfg = PrimusConfig.model_validate(
        {"model": {"name": "m", "family": "llama"}, "train": {"health": {"collective_timeout_s": 77}}}
    )
    cfg.train.global_batch_size = cfg.train.micro_batch_size
    cfg.parallel.dp_shard = 1
    jc = job_config.build_job_config(
        cfg, model_name="x", flavor="primus", output_dir="o", checkpoint_dir="c", gpu=False
    )
    assert jc.comm.init_timeout_seconds == jc.comm.train_timeout_seconds == 77


@pytest.mark.parametrize("attr", ["init_timeout_seconds", "train_timeout_seconds"])
def test_torchtitan_still_uses_the_comm_timeouts(attr):
    import inspect

    from torchtitan import train
    from torchtitan.distributed import utils

    assert attr in inspect.getsource(utils.init_distributed) + inspect.getsource(train.Trainer.train)
