"""Resume from a dist_checkpointing checkpoint equals training straight through.

The world-size-1 reference run saved at step 3 and 6; a run given only the step-3 checkpoint and
``--resume`` must reproduce steps 4-6, also at another layout (dist_checkpointing reshards). With the
distributed optimizer (DP 2) the optimizer state is saved sharded; its resume (after a rank was
killed mid-save) is in ``test_crash_safety.py``. Every checkpoint carries a manifest; only folders
named ``step_<N>`` with the manifest of step N count, and resume refuses another model shape.

Across data-parallel sizes: the regular optimizer's state (1 rank) and the distributed optimizer's (dp_shard 2,
the default on 2 ranks) are different formats that megatron-core does not convert. The regular optimizer's is per
model tensor, so a distributed optimizer takes its ranges of it (what resumes a one-process ``primus checkpoint
import`` on many ranks: primus.megatron.native_load.read_regular_into_distributed); the distributed optimizer's follows
its gradient buckets, so a resume of it with the regular optimizer is refused before anything is loaded, naming the
setting that resumes it. Each way equals straight-through training.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from megatron_helpers import LOSS_TOL, TINY, losses, primus, train


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


def test_distributed_optimizer_matches_and_saves_sharded_state(reference, dp2_straight):
    assert losses(dp2_straight["rows"]) == pytest.approx(reference["losses"], abs=LOSS_TOL)
    ckpts = dp2_straight["out"] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004", "step_00000006"]  # keep_last 2
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpts / "step_00000004")).read_metadata().state_dict_metadata
    assert any(k.startswith("optimizer.distributed.") for k in keys)  # sharded Adam state, per DP rank


def test_manifest(reference):
    from importlib.metadata import version

    man = json.loads((reference["out"] / "checkpoints" / "step_00000006" / "manifest.json").read_text())
    assert man["step"] == 6 and len(man["config_hash"]) == 64
    assert man["model_shape"]["num_layers"] == 4 and man["layout"]["world"] == 1
    assert man["versions"]["megatron-core"] == version("megatron-core") in ("0.16.1", "0.19.2")
    assert man["versions"]["torch"] == version("torch")
    seed = json.loads((reference["seed"] / "manifest.json").read_text())  # train.save_initial's: the model alone
    assert seed["step"] == 0 and seed["weights_only"]["init"] == "canonical" and "weights_only" not in man


def test_partial_folders_never_shadow_a_complete_checkpoint(reference, tmp_path):
    from primus.megatron.checkpoint import complete_checkpoints, latest

    root = tmp_path / "ckpt"
    complete = _only_step3(reference["out"] / "checkpoints", root) / "step_00000003"
    (root / "step_00000009.tmp").mkdir()  # a save cut short before its commit
    (root / "step_00000009.tmp" / "__0_0.distcp").write_bytes(b"partial")
    shutil.copytree(complete, root / "step_00000012")  # a step name without the manifest of that step
    (root / "step_00000012" / "manifest.json").unlink()
    shutil.copytree(complete, root / "step_00000015")  # a manifest of another step
    assert complete_checkpoints(root) == [(3, complete)]
    assert latest(root) == (3, complete)


def test_resume_refuses_another_model_shape(reference, tmp_path):
    ckpt = _only_step3(reference["out"] / "checkpoints", tmp_path / "ckpt")
    proc = primus(
        "train",
        TINY,
        tmp_path / "run",
        1,
        "model.num_layers=2",
        f"checkpoint.dir={ckpt}",
        "checkpoint.enabled=true",
        resume=True,
    )
    assert proc.returncode != 0
    text = " ".join(proc.stderr.split())  # the console wraps long lines
    assert "holds a model of another shape (num_layers 4 vs 2)" in text, proc.stderr[-3000:]
    assert "'num_layers': 4" in text and "'num_layers': 2" in text  # both shapes, in full


def _refused(proc, *needles: str) -> None:
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert all(n in text for n in needles), text[-3000:]
    assert "Traceback" not in proc.stderr


def test_resume_at_dp2_of_a_dp1_checkpoint(reference, tmp_path):
    """dp 1 (regular optimizer) -> 2 ranks: with dp_shard 2 the distributed optimizer takes its ranges of the saved
    state, as 2 replicas the regular optimizer the whole; both equal the reference."""
    common = ["checkpoint.enabled=true", "checkpoint.interval=100"]
    for name, layout in (("sharded", ()), ("replicas", ("parallel.dp_replicate=2", "parallel.dp_shard=1"))):
        ckpt = _only_step3(reference["out"] / "checkpoints", tmp_path / f"ckpt-{name}")
        rows = train(TINY, tmp_path / name, 2, f"checkpoint.dir={ckpt}", *common, *layout, resume=True)
        assert [r["step"] for r in rows] == [4, 5, 6], name
        assert losses(rows) == pytest.approx(reference["losses"][3:], abs=LOSS_TOL), name


def test_resume_at_dp1_of_a_dp2_checkpoint(dp2_straight, tmp_path):
    """2 ranks (distributed optimizer) -> 1 rank: refused with the regular optimizer, equal to the 2-rank run with
    parallel.distributed_optimizer=true (megatron-core reshards its state to dp 1)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(dp2_straight["out"] / "checkpoints" / "step_00000004", ckpt / "step_00000004")
    common = [f"checkpoint.dir={ckpt}", "checkpoint.enabled=true"]
    proc = primus("train", TINY, tmp_path / "regular", 1, *common, resume=True)
    _refused(proc, "holds the distributed optimizer's state", "parallel.distributed_optimizer=true")
    rows = train(TINY, tmp_path / "dist", 1, *common, "parallel.distributed_optimizer=true", resume=True)
    assert [r["step"] for r in rows] == [5, 6]
    assert losses(rows) == pytest.approx(dp2_straight["losses"][4:], abs=LOSS_TOL)


OLD_PIN = Path(__file__).parent / "fixtures" / "megatron-core-0.16.1"
# the model of the fixture's run (tiny.yaml's training, a smaller model: a committed checkpoint of ~0.9 MB)
OLD_PIN_MODEL = ["model.hidden_size=16", "model.num_layers=1", "model.ffn_hidden_size=32",
                 "model.num_attention_heads=2", "model.num_kv_heads=2", "model.head_dim=8"]  # fmt: skip


def test_a_checkpoint_of_megatron_core_0_16_resumes_on_the_installed_release(tmp_path):
    """A committed step-3 checkpoint written by megatron-core 0.16.1 (the pin before 0.19; its command is in
    fixtures/megatron-core-0.16.1/straight_through.json) resumes on the installed release (0.16.1 or 0.19.2, whose
    torch_dist format keeps the common state in the DCP files): steps 4-6 equal that run's straight-through ones, and
    the run says which versions wrote it, with no engine warning (megatron's and torch's own deprecations)."""
    from importlib.metadata import version

    ckpt = tmp_path / "ckpt"
    shutil.copytree(OLD_PIN / "step_00000003", ckpt / "step_00000003")
    expected = json.loads((OLD_PIN / "straight_through.json").read_text())["straight_through"]
    proc = primus("train", TINY, tmp_path / "run", 1, *OLD_PIN_MODEL, f"checkpoint.dir={ckpt}",
                  "checkpoint.enabled=true", resume=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert losses(rows) == pytest.approx([expected[str(s)]["loss"] for s in (4, 5, 6)], abs=1e-6)
    assert [r["grad_norm"] for r in rows] == pytest.approx([expected[str(s)]["grad_norm"] for s in (4, 5, 6)], rel=1e-4)
    said = proc.stdout + proc.stderr
    assert ("'megatron-core': '0.16.1'" in said) == (version("megatron-core") != "0.16.1"), said[-3000:]
    assert "Warning" not in said, said[-3000:]
