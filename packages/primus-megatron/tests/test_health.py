"""Training health (issue #7) with a real NaN: the test-only fault injector
(``backend.extra.fault_injection.nan_at_step``) multiplies every rank's loss by NaN on step 3, so the
loss, every gradient and the grad norm are NaN, in a 2-rank run through core's launcher (gloo,
distributed optimizer).

- ``on_nonfinite: stop``: the run fails on exactly step 3, naming it; nothing of step 3 is applied,
  logged or saved; the step-2 checkpoint stays the newest complete one.
- ``on_nonfinite: skip``: step 3's update is dropped (model, optimizer state and LR schedule are
  bit-for-bit those of step 2, read back from the checkpoints of steps 2 and 3; the LR schedule's position from
  their manifests), training goes on,
  ``skipped_steps`` is 1.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from megatron_helpers import LOSS_TOL, TINY, losses, primus, read_metrics, train

NAN_AT_3 = "backend.extra.fault_injection.nan_at_step=3"


def test_nonfinite_stops_at_the_step(reference, tmp_path):
    out = tmp_path / "stop"
    seed = f"train.init_from={reference['seed']}"
    ckpt = ["checkpoint.enabled=true", "checkpoint.interval=2"]
    proc = primus("train", TINY, out, 2, seed, NAN_AT_3, "train.health.on_nonfinite=stop", *ckpt)
    assert proc.returncode != 0
    assert "error: step 3: non-finite loss and grad norm" in proc.stderr, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"].startswith("NonFiniteError: step 3: non-finite loss and grad norm (loss nan")
    assert "on_nonfinite: stop" in summary["error"]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert losses(rows) == pytest.approx(reference["losses"][:2], abs=LOSS_TOL)
    from primus.megatron.checkpoint import latest

    assert latest(out / "checkpoints") == (2, out / "checkpoints" / "step_00000002")
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]


def _state(folder, scratch):
    """Every tensor of a megatron checkpoint (model and sharded optimizer state)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = scratch / f"{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(flat))
    return {k: v for k, v in torch.load(flat, weights_only=False).items() if torch.is_tensor(v)}


def test_nonfinite_skip_drops_the_update(reference, tmp_path):
    out = tmp_path / "skip"
    rows = train(
        TINY,
        out,
        2,
        f"train.init_from={reference['seed']}",
        NAN_AT_3,
        "train.health.on_nonfinite=skip",
        "train.steps=5",
        "checkpoint.enabled=true",
        "checkpoint.interval=1",
        "checkpoint.keep_last=4",
    )
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # steps 1-2 as the reference (warmup lr does not depend on train.steps); step 3 NaN, then training goes on
    assert losses(rows)[:2] == pytest.approx(reference["losses"][:2], abs=LOSS_TOL)
    assert math.isnan(rows[2]["loss"]) and math.isnan(rows[2]["grad_norm"])
    assert all(math.isfinite(r["loss"]) for r in rows[3:]) and rows[4]["loss"] < rows[1]["loss"]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1]
    assert all(r["loss_spikes"] == 0 for r in rows)
    assert json.loads((out / "summary.json").read_text())["metrics"]["skipped_steps"] == 1
    # the schedule counts applied updates: step 4 runs at the lr step 3 had
    assert rows[3]["lr"] == rows[2]["lr"] != rows[1]["lr"]

    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_0000000{i}" for i in (2, 3, 4, 5)]  # keep_last 4
    s2, s3, s4 = (_state(ckpts / f"step_0000000{i}", tmp_path) for i in (2, 3, 4))
    assert s2.keys() == s3.keys() and any(k.startswith("optimizer.distributed.") for k in s2)
    unchanged = [k for k in s2 if torch.equal(s2[k], s3[k])]
    assert unchanged == list(s2), set(s2) - set(unchanged)  # weights, main params, Adam moments: step 2's
    assert not torch.equal(s3["embedding.word_embeddings.weight"], s4["embedding.word_embeddings.weight"])
    # the LR schedule's position (core's count of applied updates, in each checkpoint's manifest)
    applied = [
        json.loads((ckpts / f"step_0000000{i}" / "manifest.json").read_text())["applied_steps"] for i in (2, 3, 4)
    ]
    assert applied == [2, 2, 3]
