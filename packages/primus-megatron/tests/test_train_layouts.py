"""Training on CPU with gloo: world size 1, then every parallel layout against it.

All layouts load the seed checkpoint written by the world-size-1 run (same initial weights) and
read the same global batches (fixed global order, DP ranks take slices), so their per-step losses
must equal world size 1 up to reduction order (``LOSS_TOL``).
"""

from __future__ import annotations

import pytest
from megatron_helpers import LOSS_TOL, TINY, losses, train

METRICS = ("loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "memory_gib")


def test_world_size_1_trains_and_reports(reference):
    rows = reference["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    first, last = reference["losses"][0], reference["losses"][-1]
    assert 7.0 < first < 8.0  # ≈ ln(2048): an untrained model on a 2048-token vocabulary
    assert last < first - 0.3, reference["losses"]
    for key in METRICS:
        assert all(r[key] > 0 for r in rows), key
    # warmup over 2 steps to the peak, cosine down to min_lr at the last step
    assert rows[0]["lr"] == pytest.approx(1.5e-3)
    assert rows[1]["lr"] == pytest.approx(3e-3)
    assert rows[-1]["lr"] == pytest.approx(3e-4)
    ckpts = sorted(p.name for p in (reference["out"] / "checkpoints").iterdir())
    assert ckpts == ["step_00000003", "step_00000006"]
    assert (reference["seed"] / "metadata.json").is_file()


LAYOUTS = {
    # 2 ranks: DP with the distributed optimizer and both overlaps
    "dp2_distopt_overlap": (
        2,
        [
            "parallel.dp_replicate=2",
            "parallel.dp_shard=1",
            "parallel.distributed_optimizer=true",
            "parallel.overlap_grad_reduce=true",
            "parallel.overlap_param_gather=true",
        ],
    ),
    "tp2_sp_selective_recompute": (
        2,
        ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.recompute=selective"],
    ),
    "pp2_1f1b_full_block_recompute": (
        2,
        ["parallel.pp=2", "parallel.recompute=full", "parallel.recompute_method=block", "parallel.recompute_layers=1"],
    ),
    "pp2_vpp2_interleaved": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b"]),
    # context parallelism: primus-turbo's ring attention as megatron's core attention, the sequence in 2 x cp chunks
    "cp2": (2, ["parallel.cp=2"]),
    # 4 ranks: optimizer state sharded within each dp_shard pair, replicated across dp_replicate
    "dp_replicate2_x_dp_shard2_4ranks": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "tp2_sp_x_cp2_4ranks": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2"]),
    "tp2_pp2_4ranks": (
        4,
        [
            "parallel.tp=2",
            "parallel.pp=2",
            "parallel.recompute=full",
            "parallel.recompute_method=uniform",
            "parallel.recompute_layers=1",
        ],
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_world_size_1(reference, tmp_path, name):
    nproc, overrides = LAYOUTS[name]
    rows = train(TINY, tmp_path / name, nproc, f"train.init_from={reference['seed']}", *overrides)
    assert losses(rows) == pytest.approx(reference["losses"], abs=LOSS_TOL), name
    ref_norms = [r["grad_norm"] for r in reference["rows"]]
    assert [r["grad_norm"] for r in rows] == pytest.approx(ref_norms, rel=1e-3), name
