"""Crash safety (issue #7): a rank killed with SIGKILL in the middle of a checkpoint save, then
``--resume``: training continues from the last complete checkpoint with the losses of an
uninterrupted run.

2 ranks through core's launcher (``primus train --nproc-per-node 2``: torchrun, gloo, CPU), FSDP
dp_shard 2, a checkpoint every 2 steps. The test-only fault injector ``kill_during_save_at_step: 4``
SIGKILLs rank 1 once its DCP files of the step-4 checkpoint are written and before the checkpoint is
committed; torchrun then tears the job down. The step-4 folder stays a ``.tmp`` without manifest, so
resume takes step 2 and replays steps 3-8: in fp32 on the same layout and weights the resumed losses
equal the uninterrupted run's (``fsdp2_straight``) to 1e-6 (measured: bit-identical).
"""

from __future__ import annotations

import json

import pytest
from conftest import TINY, metrics, primus_train

from primus.torchtitan.checkpoint import complete_steps

RESUME_TOL = 1e-6


def test_kill_during_save_then_resume(fsdp2_straight, tmp_path):
    ckpt = tmp_path / "ckpt"
    common = [*fsdp2_straight["overrides"], f"checkpoint.dir={ckpt}"]
    crashed = tmp_path / "crashed"
    kill = "backend.extra.fault_injection.kill_during_save_at_step=4"
    proc = primus_train(TINY, crashed, *common, kill, nproc=2, check=False)
    assert proc.returncode != 0
    stderr = " ".join(proc.stderr.split())
    assert "fault injection: rank 1 killed while writing the step-4" in stderr, proc.stderr[-4000:]
    assert "error: rank 1 (pid " in stderr and "was killed by SIGKILL; the job stopped (exit code 137)" in stderr
    assert [r["step"] for r in metrics(crashed)] == [1, 2, 3, 4]

    # the interrupted save left DCP's files (even its .metadata), but no manifest and no final name
    partial = ckpt / "step_00000004.tmp"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000002", "step_00000004.tmp"]
    assert any(partial.glob("*.distcp")) and not (partial / "manifest.json").exists()
    assert complete_steps(ckpt) == [2]

    resumed = tmp_path / "resumed"
    primus_train(TINY, resumed, *common, nproc=2, resume=True)
    rows = metrics(resumed)
    assert [r["step"] for r in rows] == [3, 4, 5, 6, 7, 8]
    straight = fsdp2_straight["rows"][2:]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in straight], abs=RESUME_TOL)
    assert [r["lr"] for r in rows] == pytest.approx([r["lr"] for r in straight])
    # keep_last 2 (the default) kept the newest two; the leftover .tmp went with the step-4 save
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000006", "step_00000008"]
    assert json.loads((ckpt / "step_00000008" / "manifest.json").read_text())["step"] == 8


def test_kill_during_the_first_save_then_resume_starts_from_the_initial_weights(fsdp2_straight, tmp_path):
    """Nothing complete to resume: the run starts over from the seed checkpoint (torchtitan alone would
    take the existing checkpoint folder for a resume and start from random weights)."""
    ckpt = tmp_path / "ckpt"
    common = [*fsdp2_straight["overrides"], f"checkpoint.dir={ckpt}"]
    kill = "backend.extra.fault_injection.kill_during_save_at_step=2"
    proc = primus_train(TINY, tmp_path / "crashed", *common, kill, nproc=2, check=False)
    assert proc.returncode != 0 and sorted(p.name for p in ckpt.iterdir()) == ["step_00000002.tmp"]
    resumed = tmp_path / "resumed"
    proc = primus_train(TINY, resumed, *common, nproc=2, resume=True)
    assert "no complete checkpoint" in proc.stderr
    rows = metrics(resumed)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows] == pytest.approx(fsdp2_straight["losses"], abs=RESUME_TOL)
