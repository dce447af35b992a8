"""FSDP2 under Megatron-Core (``parallel.fsdp: true``): parameters, gradients and optimizer state sharded over the
data-parallel ranks by PyTorch's fully_shard (megatron-core's TorchFullyShardedDataParallel).

One 4-rank run (FSDP2 2 × TP 2 with sequence parallel, full recompute, the gradient reduce overlapped; checkpoints at
steps 3 and 6) from the reference's seed weights: its loss curve and gradient norms equal world size 1's (fp32; the
norm sums each rank's squared shards once). Its step-3 checkpoint resumed under FSDP2 2 on 2 ranks and at world size 1
(megatron's regular optimizer) continues the reference's curve: the shards sit where the global tensors say (the
SwiGLU weight's rows included), and the Adam state comes back as DTensors. ``primus checkpoint export`` reads a
checkpoint at world size 1 through the same load as the world-1 resume (the HF tests check the conversion).
"""

from __future__ import annotations

import shutil

import pytest
from megatron_helpers import LOSS_TOL, TINY, losses, train

FSDP2_TP2 = [
    "parallel.fsdp=true",
    "parallel.tp=2",
    "parallel.sequence_parallel=true",
    "parallel.recompute=full",
    "parallel.overlap_grad_reduce=true",
]


def _step(out, step: int, dst):
    dst.mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / f"step_{step:08d}", dst / f"step_{step:08d}")
    return dst


@pytest.fixture(scope="module")
def runs(reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_fsdp2")
    seed = f"train.init_from={reference['seed']}"
    out = root / "fsdp2_tp2"
    rows = train(TINY, out, 4, seed, *FSDP2_TP2, "checkpoint.enabled=true", "checkpoint.interval=3")
    resumed = {}
    for name, nproc, layout in (("fsdp2", 2, ["parallel.fsdp=true"]), ("world1", 1, [])):
        ckpt = _step(out, 3, root / f"ckpt_{name}")
        resumed[name] = train(
            TINY, root / name, nproc, *layout, f"checkpoint.dir={ckpt}", "checkpoint.enabled=true", resume=True
        )
    return {"root": root, "out": out, "rows": rows, "resumed": resumed}


def test_loss_and_grad_norm_equal_world_size_1(reference, runs):
    assert losses(runs["rows"]) == pytest.approx(reference["losses"], abs=LOSS_TOL)
    norms = [r["grad_norm"] for r in runs["rows"]]
    assert norms == pytest.approx([r["grad_norm"] for r in reference["rows"]], rel=1e-4)


@pytest.mark.parametrize("name", ["fsdp2", "world1"])
def test_checkpoint_resumes_in_another_layout(reference, runs, name):
    rows = runs["resumed"][name]
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert losses(rows) == pytest.approx(reference["losses"][3:], abs=LOSS_TOL)


def test_checkpoint_holds_the_regular_optimizer_state(runs):
    from primus.megatron.checkpoint import optimizer_sharded

    assert optimizer_sharded(runs["out"] / "checkpoints" / "step_00000003") is False
