"""The same recipe is the same run on both engines and every layout: with the default schedule (warmup, cosine
decay, clipping on, weight decay with norms and biases exempt) and no seed checkpoint, Megatron and TorchTitan on
1, 2 and 4 gloo ranks (DP with the distributed optimizer, FSDP, TP, PP) use the same learning rate at every step
(core's schedule, primus.core.schedule) and train the same loss curve from the same initial weights (core's
canonical init, primus.core.init), within fp32 reduction-order tolerance; and both engines report the same
metrics (one definition each, primus.core.loop.METRICS: memory included).
"""

from __future__ import annotations

import pytest
from hf_helpers import run_config, train

STEPS = 6
# fp32 on CPU: the engines and layouts differ in reduction order only (fused vs split GEMMs, sharded sums,
# megatron's fp64 grad-norm accumulation); measured within 1e-6 relative
LOSS_RTOL = 2e-5
RUNS = {
    "megatron": ("megatron", 1, []),
    "torchtitan": ("torchtitan", 1, []),
    "megatron-dp2": ("megatron", 2, []),  # dp_shard 2: the distributed optimizer
    "megatron-pp2": ("megatron", 2, ["parallel.pp=2"]),
    "torchtitan-fsdp2": ("torchtitan", 2, []),
    "torchtitan-tp2": ("torchtitan", 2, ["parallel.tp=2"]),
    "torchtitan-pp2": ("torchtitan", 2, ["parallel.pp=2"]),
    "megatron-tp2-dp2": ("megatron", 4, ["parallel.tp=2"]),
    "torchtitan-fsdp2-tp2": ("torchtitan", 4, ["parallel.tp=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("same_run")
    train_section = {
        "steps": STEPS,
        "grad_clip": 1.0,
        "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "weight_decay": 0.1},
        "schedule": {"warmup_steps": 2, "decay": "cosine"},
    }
    out = {}
    for name, (backend, nproc, overrides) in RUNS.items():
        config = run_config(root / f"{name}.yaml", backend, train=train_section, checkpoint={"enabled": False})
        out[name] = train(config, root / name, *overrides, nproc=nproc)
    return out


def test_every_engine_and_layout_uses_cores_learning_rates(runs):
    from primus.core.config.schema import TrainConfig
    from primus.core.schedule import lr_at

    t = TrainConfig(
        steps=STEPS, optimizer={"lr": 3.0e-3, "min_lr": 3.0e-4}, schedule={"warmup_steps": 2, "decay": "cosine"}
    )
    want = [lr_at(n, t) for n in range(1, STEPS + 1)]
    assert want[0] == pytest.approx(1.5e-3) and want[-1] == pytest.approx(3.0e-4)
    for name, rows in runs.items():
        assert [r["lr"] for r in rows] == want, name


def test_every_engine_and_layout_trains_the_same_loss_curve(runs):
    ref = [r["loss"] for r in runs["megatron"]]
    assert len(ref) == STEPS and ref[-1] < ref[0] - 0.05  # it trains
    for name, rows in runs.items():
        assert [r["loss"] for r in rows] == pytest.approx(ref, rel=LOSS_RTOL), name
        assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in runs["megatron"]], rel=1e-4)


def test_both_engines_report_the_same_metrics(runs):
    from primus.core.loop import METRICS

    on_cpu = {"step", "time", *METRICS} - {"mfu"}  # no peak FLOP/s on a CPU
    for name, rows in runs.items():
        assert all(set(r) == on_cpu for r in rows), (name, set(rows[0]) ^ on_cpu)
        assert all(r["memory_gib"] > 0 and r["tokens_per_s"] > 0 for r in rows), name
        nproc = RUNS[name][1]
        assert rows[-1]["tokens_per_s_per_device"] == pytest.approx(rows[-1]["tokens_per_s"] / nproc)
