"""Whole runs resumed from Primus's atomic checkpoints: what the manifest records, resume at another
data-parallel size (DCP reshards the FSDP model and optimizer state, the data loader continues at the
same global sample), and the refusal of a checkpoint of another model shape.

The reference is ``fsdp2_straight`` (conftest): 2 ranks, FSDP dp_shard 2, 8 steps from the seed
checkpoint, a checkpoint every 2 steps. Tolerance: resumed losses equal it to 1e-6 (fp32 on CPU). The
math allows it: the global batch of 4 is 2 micro-batches of 2 samples in both layouts; one rank
accumulates their gradients in order, two ranks each compute one and FSDP's reduce-scatter sums them
in the same order; Adam's update is elementwise, so sharding it changes nothing (measured: bit-identical
losses; the grad norm, a sum of squares taken per shard then added, differs by ~3e-5 relative).
"""

from __future__ import annotations

import json
import shutil
from importlib.metadata import version

import pytest
from conftest import TINY, metrics, primus_train

RESUME_TOL = 1e-6


def _only(src, step, dst):
    dst.mkdir(parents=True)
    shutil.copytree(src / f"step_{step:08d}", dst / f"step_{step:08d}")
    return dst


def test_manifest_records_step_shape_layout_and_versions(fsdp2_straight):
    ckpts = fsdp2_straight["out"] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "step_00000002",
        "step_00000004",
        "step_00000006",
        "step_00000008",
    ]
    man = json.loads((ckpts / "step_00000008" / "manifest.json").read_text())
    assert man["step"] == 8 and len(man["config_hash"]) == 64 and man["model_name"] == "tiny-llama"
    assert man["model_shape"]["num_layers"] == 2 and man["model_shape"]["hidden_size"] == 128
    assert man["layout"]["world"] == 2 and man["layout"]["dp"] == 2 and man["layout"]["dp_shard"] == 2
    assert man["versions"]["torchtitan"] == "0.2.2" and man["versions"]["torch"] == version("torch")
    assert man["versions"]["primus-torchtitan"] == version("primus-torchtitan")
    assert man["time"].endswith("Z") and "seed" not in man
    assert (ckpts / "step_00000008" / ".metadata").is_file()  # DCP's own files, under the final name


def test_resume_at_another_data_parallel_size(fsdp2_straight, tmp_path):
    """2 ranks -> 1 rank (steps 5-8, saving step 6) -> 2 ranks again (steps 7-8)."""
    straight = fsdp2_straight["rows"]
    one = _only(fsdp2_straight["out"] / "checkpoints", 4, tmp_path / "ckpt1")
    primus_train(TINY, tmp_path / "dp1", f"checkpoint.dir={one}", "checkpoint.interval=2", resume=True)
    rows = metrics(tmp_path / "dp1")
    assert [r["step"] for r in rows] == [5, 6, 7, 8]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in straight[4:]], abs=RESUME_TOL)
    # the grad norm is a sum of squares over the whole model here, of two shards' partial sums under FSDP
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in straight[4:]], rel=1e-4)
    assert [r["lr"] for r in rows] == pytest.approx([r["lr"] for r in straight[4:]])
    assert json.loads((one / "step_00000006" / "manifest.json").read_text())["layout"]["dp"] == 1

    two = _only(one, 6, tmp_path / "ckpt2")
    primus_train(TINY, tmp_path / "dp2", f"checkpoint.dir={two}", "parallel.dp_shard=2", nproc=2, resume=True)
    rows = metrics(tmp_path / "dp2")
    assert [r["step"] for r in rows] == [7, 8]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in straight[6:]], abs=RESUME_TOL)


def test_resume_refuses_another_model_shape(fsdp2_straight, tmp_path):
    ckpt = _only(fsdp2_straight["out"] / "checkpoints", 4, tmp_path / "ckpt")
    proc = primus_train(
        TINY, tmp_path / "run", "model.num_layers=3", f"checkpoint.dir={ckpt}", resume=True, check=False
    )
    assert proc.returncode != 0
    text = " ".join(proc.stderr.split())  # the console wraps long lines
    assert "holds a model of another shape (num_layers 2 vs 3)" in text, proc.stderr[-3000:]
    assert "'num_layers': 2" in text and "'num_layers': 3" in text  # both shapes, in full
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step
