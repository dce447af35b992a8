"""Crash safety (issue #7): a rank killed with SIGKILL in the middle of a checkpoint save, then
``--resume``: training continues from the last complete checkpoint with the losses of an
uninterrupted run.

2 ranks through core's launcher (torchrun), distributed optimizer, checkpoints every 2 steps. The
test-only fault injector ``kill_during_save_at_step: 4`` SIGKILLs rank 1 once its shard files of the
step-4 checkpoint are written and before the checkpoint is committed; torchrun then tears the job
down. The step-4 folder stays a ``.tmp`` without manifest, so resume takes step 2 and replays steps
3-6: in fp32 on the same layout and weights the resumed losses equal the uninterrupted run's to 1e-6
(measured: bit-identical).
"""

from __future__ import annotations

import json

import pytest
from megatron_helpers import TINY, losses, primus, read_metrics, train

from primus.megatron.checkpoint import latest

RESUME_TOL = 1e-6


def test_kill_during_save_then_resume(dp2_straight, tmp_path):
    ckpt = tmp_path / "ckpt"
    common = [*dp2_straight["overrides"], f"checkpoint.dir={ckpt}"]
    crashed = tmp_path / "crashed"
    proc = primus("train", TINY, crashed, 2, *common, "backend.extra.fault_injection.kill_during_save_at_step=4")
    assert proc.returncode != 0
    stderr = " ".join(proc.stderr.split())
    assert "fault injection: rank 1 killed while writing the step-4 checkpoint" in stderr, proc.stderr[-4000:]
    assert "error: rank 1 (pid " in stderr and "was killed by SIGKILL; the job stopped (exit code 137)" in stderr
    assert [r["step"] for r in read_metrics(crashed)] == [1, 2, 3, 4]

    # the interrupted save left files, but no manifest and no final name: not a checkpoint
    partial = ckpt / "step_00000004.tmp"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000002", "step_00000004.tmp"]
    assert any(partial.glob("*.distcp")) and not (partial / "manifest.json").exists()
    assert latest(ckpt) == (2, ckpt / "step_00000002")

    resumed = tmp_path / "resumed"
    rows = train(TINY, resumed, 2, *common, resume=True)
    assert json.loads((resumed / "summary.json").read_text())["start_step"] == 2
    assert [r["step"] for r in rows] == [3, 4, 5, 6]
    assert losses(rows) == pytest.approx(dp2_straight["losses"][2:], abs=RESUME_TOL)
    assert [r["lr"] for r in rows] == pytest.approx([r["lr"] for r in dp2_straight["rows"][2:]])
    # keep_last 2 (the default) kept the newest two; the leftover .tmp was cleared by the step-4 save
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000004", "step_00000006"]
    assert json.loads((ckpt / "step_00000006" / "manifest.json").read_text())["step"] == 6
