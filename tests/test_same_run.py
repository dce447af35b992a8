"""The same recipe is the same run on both engines and every layout: with the default schedule (warmup, cosine
decay, clipping on, weight decay with norms and biases exempt) and no seed checkpoint, Megatron and TorchTitan on
1 and 2 gloo ranks (DP with the distributed optimizer, FSDP, TP, PP) use the same learning rate at every step
(core's schedule, primus.core.run.schedule) and train the same loss curve from the same initial weights (core's
canonical init, primus.core.run.initial_weights), within fp32 reduction-order tolerance; and both engines report the same
metrics (one definition each, primus.core.run.loop.METRICS: memory included).

Every run also evaluates (``eval``: a held-out 10% of the samples, every 3 steps, forward only): the evaluation
losses are equal across engines and layouts, equal to ``transformers``' loss of the exported model on the same
held-out tokens and to ``primus eval`` of the checkpoint on another layout, and evaluating leaves training as it
was (runs with evaluation off train the same curve to the last bit).

Layouts of 4 ranks (TP × DP, TP × CP, TP × PP, HSDP) train world size 1's curve in each engine's own layout tests
(primus-megatron's test_train_layouts.py, primus-torchtitan's test_train.py); with the two engines equal at one
rank here, they equal each other too.
"""

from __future__ import annotations

import json
import math

import pytest
from hf_helpers import primus, run_config, train

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
    # the same held-out samples, no evaluation: training must not notice it
    "megatron-no-eval": ("megatron", 1, ["eval.interval=0"]),
    "torchtitan-no-eval": ("torchtitan", 1, ["eval.interval=0"]),
}
EVAL = {"holdout": 0.1, "interval": 3, "batches": 2}
EVAL_STEPS = [3, 6]
# the 1-rank runs keep their final checkpoint, for the evaluations of it below
CHECKPOINTED = ("megatron", "torchtitan")


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
        config = run_config(
            root / f"{name}.yaml", backend, train=train_section, checkpoint={"enabled": False}, eval=EVAL
        )
        if name in CHECKPOINTED:
            overrides = [*overrides, "checkpoint.enabled=true"]
        out[name] = train(config, root / name, *overrides, nproc=nproc)
    out["root"] = root
    return out


def _runs(runs) -> dict[str, list[dict]]:
    return {name: rows for name, rows in runs.items() if name != "root"}


def test_every_engine_and_layout_uses_cores_learning_rates(runs):
    from primus.core.config.schema import TrainConfig
    from primus.core.run.schedule import lr_at

    t = TrainConfig(
        steps=STEPS, optimizer={"lr": 3.0e-3, "min_lr": 3.0e-4}, schedule={"warmup_steps": 2, "decay": "cosine"}
    )
    want = [lr_at(n, t) for n in range(1, STEPS + 1)]
    assert want[0] == pytest.approx(1.5e-3) and want[-1] == pytest.approx(3.0e-4)
    for name, rows in _runs(runs).items():
        assert [r["lr"] for r in rows] == want, name


def test_every_engine_and_layout_trains_the_same_loss_curve(runs):
    ref = [r["loss"] for r in runs["megatron"]]
    assert len(ref) == STEPS and ref[-1] < ref[0] - 0.05  # it trains
    for name, rows in _runs(runs).items():
        assert [r["loss"] for r in rows] == pytest.approx(ref, rel=LOSS_RTOL), name
        assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in runs["megatron"]], rel=1e-4)


def test_both_engines_report_the_same_metrics(runs):
    from primus.core.run.evaluation import EVAL_METRICS
    from primus.core.run.loop import METRICS

    on_cpu = {"step", "time", *METRICS} - {"mfu"}  # no peak FLOP/s on a CPU
    for name, rows in _runs(runs).items():
        evaluated = EVAL_STEPS if "no-eval" not in name else []
        for r in rows:
            want = on_cpu | (set(EVAL_METRICS) if r["step"] in evaluated else set())
            assert set(r) == want, (name, r["step"], set(r) ^ want)
        assert all(r["memory_gib"] > 0 and r["tokens_per_s"] > 0 for r in rows), name
        nproc = RUNS[name][1]
        assert rows[-1]["tokens_per_s_per_device"] == pytest.approx(rows[-1]["tokens_per_s"] / nproc)


def _eval_losses(rows: list[dict]) -> list[float]:
    return [r["eval_loss"] for r in rows if "eval_loss" in r]


def test_evaluation_is_the_same_on_every_engine_and_layout(runs):
    ref = _eval_losses(runs["megatron"])
    assert len(ref) == len(EVAL_STEPS) and ref[1] < ref[0]  # the held-out loss falls as the model trains
    for name, rows in _runs(runs).items():
        if "no-eval" not in name:
            assert _eval_losses(rows) == pytest.approx(ref, rel=LOSS_RTOL), name
            assert [r["eval_perplexity"] for r in rows if "eval_loss" in r] == pytest.approx(
                [math.exp(x) for x in _eval_losses(rows)]
            )


def test_evaluation_leaves_training_as_it_was(runs):
    for backend in ("megatron", "torchtitan"):
        off, on = runs[f"{backend}-no-eval"], runs[backend]
        assert [(r["loss"], r["grad_norm"]) for r in off] == [(r["loss"], r["grad_norm"]) for r in on], backend


def test_eval_loss_is_transformers_loss_on_the_held_out_tokens(runs, tmp_path):
    """The torchtitan run's final evaluation = the exported model's mean token loss in ``transformers`` over the
    held-out samples core names (the first eval.batches × global_batch_size of them)."""
    import torch
    import transformers

    from primus.core.data.splits import eval_samples
    from primus.core.launch.resolve import resolve

    root = runs["root"]
    exported = tmp_path / "hf"
    primus("checkpoint", "export", str(root / "torchtitan" / "checkpoints"), "--to-hf", str(exported))
    cfg = resolve(str(root / "torchtitan.yaml"), ["checkpoint.enabled=true"]).config
    samples = eval_samples(cfg)
    n = EVAL["batches"] * cfg.train.global_batch_size
    inputs = torch.stack([torch.from_numpy(samples[i][0]) for i in range(n)])
    labels = torch.stack([torch.from_numpy(samples[i][1]) for i in range(n)])
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(inputs).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    assert _eval_losses(runs["torchtitan"])[-1] == pytest.approx(want, rel=1e-5)


def test_primus_eval_of_a_checkpoint_on_another_layout(runs, tmp_path):
    """``primus eval`` of the megatron run's final checkpoint, on 2 ranks as a 2-stage pipeline (megatron's
    forward-only pipeline schedule), gives the run's own final evaluation."""
    root = runs["root"]
    result = tmp_path / "eval.json"
    primus(
        "eval",
        str(root / "megatron.yaml"),
        f"logging.output_dir={tmp_path / 'scratch'}",
        "parallel.pp=2",
        "--checkpoint",
        str(root / "megatron" / "checkpoints"),
        "--nproc-per-node",
        "2",
        "--output",
        str(result),
        timeout=300,
    )
    got = json.loads(result.read_text())
    assert got["step"] == STEPS and got["checkpoint"].endswith(f"step_{STEPS:08d}")
    assert got["eval_loss"] == pytest.approx(_eval_losses(runs["megatron"])[-1], rel=LOSS_RTOL)
