"""Resume from a dist_checkpointing checkpoint equals training straight through.

The world-size-1 reference run saved at step 3 and 6; a run given only the step-3 checkpoint and
``--resume`` must reproduce steps 4-6. With the distributed optimizer (DP 2) the same holds, and a
checkpoint written at one layout resumes at another (dist_checkpointing reshards).
"""

from __future__ import annotations

import shutil

import pytest
from megatron_helpers import LOSS_TOL, TINY, losses, train

# The default split of 2 ranks: dp_shard = 2, which shards the optimizer state (the distributed optimizer).
DP2: list[str] = []


def _only_step3(src, dst):
    dst.mkdir(parents=True)
    shutil.copytree(src / "step_00000003", dst / "step_00000003")
    return dst


def test_resume_equals_straight_through(reference, tmp_path):
    ckpt = _only_step3(reference["out"] / "checkpoints", tmp_path / "ckpt")
    rows = train(TINY, tmp_path / "resumed", 1, f"checkpoint.dir={ckpt}", "checkpoint.enabled=true", resume=True)
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert losses(rows) == pytest.approx(reference["losses"][3:], abs=1e-6)
    assert [r["lr"] for r in rows] == pytest.approx([r["lr"] for r in reference["rows"][3:]])
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000003", "step_00000006"]


def test_resume_at_another_layout(reference, tmp_path):
    """Saved at world size 1, resumed with TP 2: the same steps 4-6 (up to reduction order)."""
    ckpt = _only_step3(reference["out"] / "checkpoints", tmp_path / "ckpt")
    rows = train(
        TINY, tmp_path / "tp2", 2, "parallel.tp=2", f"checkpoint.dir={ckpt}", "checkpoint.enabled=true", resume=True
    )
    assert losses(rows) == pytest.approx(reference["losses"][3:], abs=LOSS_TOL)


def test_resume_with_distributed_optimizer(reference, tmp_path):
    seed = f"backend.extra.seed_checkpoint={reference['seed']}"
    # saved while parameter all-gathers overlap the forward: the save must wait for the gathered weights
    straight = train(
        TINY,
        tmp_path / "straight",
        2,
        seed,
        *DP2,
        "parallel.overlap_grad_reduce=true",
        "parallel.overlap_param_gather=true",
        "checkpoint.enabled=true",
        "checkpoint.interval=3",
    )
    assert losses(straight) == pytest.approx(reference["losses"], abs=LOSS_TOL)
    ckpt = _only_step3(tmp_path / "straight" / "checkpoints", tmp_path / "ckpt")
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt / "step_00000003")).read_metadata().state_dict_metadata
    assert any(k.startswith("optimizer.distributed.") for k in keys)  # sharded Adam state, per DP rank
    rows = train(TINY, tmp_path / "resumed", 2, *DP2, f"checkpoint.dir={ckpt}", "checkpoint.enabled=true", resume=True)
    assert losses(rows) == pytest.approx(losses(straight)[3:], abs=1e-6)
