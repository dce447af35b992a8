"""A mixture-of-experts recipe is the same run on both engines: tiny-qwen3-moe (8 experts, top 2, renormalised
softmax router) from core's canonical initial weights (routers and every expert drawn by its Hugging Face name,
primus.core.run.initial_weights) trains the same loss curve on Megatron-Core and on TorchTitan (its qwen3 MoE), both with their
experts on the grouped_gemm provider, and routes the same tokens to the same experts (core's expert-load metrics,
primus.core.run.expert_load, from each engine's routers). Expert parallelism equals one rank on each engine (their packages' test_moe.py), so EP 2 of either engine
trains this curve too (checked once, when this test was written: both EP 2 runs within the tolerances below).

With one shared expert beside the routed ones (core's names for it, DeepSeek's) the two engines train the same
curve too. No load balancing here (loss-free balancing's bias updates are each engine's own algorithm, tested in its
package); with the auxiliary losses the engines train the same curve too: tests/test_moe_balancing_same_run.py,
within this file's tolerances. Measured (fp32, CPU):
the engines' losses within 2e-6 relative over 6 steps, grad norms within 5e-5 but at one step: 7.2e-4 at step 6 on
the bundled corpus as a clean interpreter walks it (the layouts of each engine's own MoE tests move at that step too).
"""

from __future__ import annotations

import json

import pytest
import yaml
from hf_helpers import train

from primus.core.run.testing import built_once

STEPS = 6
LOSS_RTOL, GNORM_RTOL = 2e-5, 1e-3
SHARED = ["model.moe.shared_experts=1"]  # one shared expert every token takes beside its top 2
RUNS = {
    "megatron": ("megatron", 1, []),
    "torchtitan": ("torchtitan", 1, []),
    "megatron-shared": ("megatron", 1, SHARED),
    "torchtitan-shared": ("torchtitan", 1, SHARED),
}
RECIPE = {
    "extends": ["tiny-qwen3-moe"],
    "model": {"moe": {"balancing": "none"}},
    "train": {
        "seq_len": 64,
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "steps": STEPS,
        "precision": "fp32",
        "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "weight_decay": 0.01},
        "schedule": {"warmup_steps": 2, "decay": "cosine"},
    },
    "data": {"source": "bundled", "tokenizer": "bundled"},
    "logging": {"interval": 1, "tensorboard": False, "progress": False},
    "checkpoint": {"enabled": False},
}


def train_recipe(root, name: str, backend: str, nproc: int = 1, overrides=()) -> list[dict]:
    root.mkdir(parents=True, exist_ok=True)
    config = root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(RECIPE | {"backend": {"name": backend}}, sort_keys=False))
    return train(config, root / name, *overrides, nproc=nproc)


def torchtitan_run(tmp_path_factory) -> list[dict]:
    """TorchTitan on the recipe as it is (one rank, no balancing): this file's "torchtitan" and
    test_moe_balancing_same_run's "torchtitan-none", the same run, trained once for both (either pytest-xdist
    worker)."""
    folder = built_once(
        tmp_path_factory, "moe_same_run_torchtitan", lambda root: train_recipe(root, "run", "torchtitan")
    )
    return [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("moe_same_run")
    out = {}
    for name, (backend, nproc, overrides) in RUNS.items():
        if name == "torchtitan":
            out[name] = torchtitan_run(tmp_path_factory)
        else:
            out[name] = train_recipe(root, name, backend, nproc, overrides)
    return out


def test_moe_trains_the_same_curve_on_both_engines(runs):
    ref = runs["megatron"]
    losses = [r["loss"] for r in ref]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.4, losses  # it trains
    for name in ("megatron", "torchtitan"):
        rows = runs[name]
        assert [r["loss"] for r in rows] == pytest.approx(losses, rel=LOSS_RTOL), name
        assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref], rel=GNORM_RTOL), name


def test_with_shared_experts_too(runs):
    """Shared experts (canonical weights under core's names for them, mlp.shared_experts.*_proj, DeepSeek's; megatron's
    SharedExpertMLP, TorchTitan's shared FeedForward): the same curve on both engines, not the routed-only one."""
    ref = runs["megatron-shared"]
    rows = runs["torchtitan-shared"]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=LOSS_RTOL)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref], rel=GNORM_RTOL)
    assert abs(ref[1]["loss"] - runs["megatron"][1]["loss"]) > 1e-4  # the shared expert changes the run


def test_canonical_init_is_the_default_for_routed_and_shared_experts(runs):
    """No train.init in the recipe: a MoE model starts from the canonical weights (else the engines' own
    initialisations would differ from the first step)."""
    for a, b in (("megatron", "torchtitan"), ("megatron-shared", "torchtitan-shared")):
        assert runs[a][0]["loss"] == pytest.approx(runs[b][0]["loss"], rel=1e-6)


def test_both_engines_route_the_same_tokens_to_the_same_experts(runs):
    """moe_load_max / moe_load_min (busiest and idlest expert against the even share, worst layer) from each engine's
    routers: equal across engines, step by step, and uneven as an unbalanced router is."""
    for key in ("moe_load_max", "moe_load_min"):
        ref = [r[key] for r in runs["megatron"]]
        assert [r[key] for r in runs["torchtitan"]] == pytest.approx(ref, rel=1e-6), key
    assert all(r["moe_load_max"] > 1 > r["moe_load_min"] >= 0 for r in runs["megatron"])
    # no balancing: no aux loss to report (megatron reports it with aux-loss balancing: its own tests)
    assert not any("moe_aux_loss" in r for rows in runs.values() for r in rows)
