"""Auxiliary-loss balancing is the same run on both engines: core's definition (primus.core.run.balancing: Switch's
``E * sum_i f_i P_i`` over each routed micro-batch, ``balancing: aux_loss``, and over each sequence, DeepSeek-V3's
``seq_aux_loss_coeff``) equals megatron-core's own ``aux_loss`` / ``seq_aux_loss`` (its TopKRouter's methods, on
the same logits), and TorchTitan, whose MoE has no auxiliary loss, trains with core's (primus.torchtitan.balancing)
the curve megatron trains with its own: from core's canonical weights, on the same data, on one rank and under
expert parallelism 2 (gloo), the losses, grad norms and ``moe_aux_loss`` / ``moe_seq_aux_loss`` of every step agree
(tolerances of tests/test_moe_same_run.py for the curves). The coefficients are large (1.0 and 0.5: a step-1 grad
norm of 3.17 against 1.81 without), so a loss left out of the gradient, or scaled wrongly, moves the curve.

Measured (fp32, CPU, 6 steps): TorchTitan's losses within 3e-7 relative of megatron's, grad norms within 4e-6, the
aux losses within 2e-6 (tiny-qwen3-moe, one rank and EP 2 on both engines; tiny-deepseek's sigmoid scores: 1e-7).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import yaml
from hf_helpers import primus, train
from test_moe_same_run import GNORM_RTOL, LOSS_RTOL, RECIPE, torchtitan_run

AUX_RTOL = 1e-5
AUX = ["model.moe.balancing=aux_loss", "model.moe.aux_loss_coeff=1.0", "model.moe.seq_aux_loss_coeff=0.5"]
EP2 = {"megatron": ["parallel.ep=2"], "torchtitan": ["parallel.dp_shard=2", "parallel.ep=2"]}
# name -> (recipe's model preset, backend, ranks, overrides)
RUNS = {
    "megatron": ("tiny-qwen3-moe", "megatron", 1, AUX),
    "torchtitan": ("tiny-qwen3-moe", "torchtitan", 1, AUX),
    "megatron-ep2": ("tiny-qwen3-moe", "megatron", 2, AUX + EP2["megatron"]),
    "torchtitan-ep2": ("tiny-qwen3-moe", "torchtitan", 2, AUX + EP2["torchtitan"]),
    "torchtitan-none": ("tiny-qwen3-moe", "torchtitan", 1, []),  # the recipe's: no balancing
    # DeepSeek's sigmoid router (scores normalised over the experts), its loss-free bias beside the sequence-wise loss
    "megatron-deepseek": ("tiny-deepseek", "megatron", 1, ["model.moe.seq_aux_loss_coeff=0.5"]),
    "torchtitan-deepseek": ("tiny-deepseek", "torchtitan", 1, ["model.moe.seq_aux_loss_coeff=0.5"]),
}
PAIRS = [("megatron", "torchtitan"), ("megatron-ep2", "torchtitan-ep2"), ("megatron-deepseek", "torchtitan-deepseek")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("moe_balancing")
    out = {}
    for name, (model, backend, nproc, overrides) in RUNS.items():
        if name == "torchtitan-none":  # test_moe_same_run's "torchtitan" run, the same one: trained once for both
            out[name] = torchtitan_run(tmp_path_factory)
            continue
        config = root / f"{name}.yaml"
        recipe = RECIPE | {"extends": [model], "backend": {"name": backend}}
        if model != "tiny-qwen3-moe":
            del recipe["model"]  # the preset's own balancing (tiny-deepseek: loss-free)
        config.write_text(yaml.safe_dump(recipe, sort_keys=False))
        out[name] = train(config, root / name, *overrides, nproc=nproc)
    return out


@pytest.mark.parametrize(("ref", "got"), PAIRS, ids=["one-rank", "ep2", "deepseek"])
def test_torchtitan_trains_megatrons_aux_loss_curve(runs, ref, got):
    a, b = runs[ref], runs[got]
    assert len(a) == len(b) == RECIPE["train"]["steps"]
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=LOSS_RTOL)
    assert [r["grad_norm"] for r in b] == pytest.approx([r["grad_norm"] for r in a], rel=GNORM_RTOL)
    keys = ["moe_seq_aux_loss"] + (["moe_aux_loss"] if "deepseek" not in ref else [])
    for key in keys:
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=AUX_RTOL), key
    if "deepseek" in ref:  # loss-free balancing: no batch-wise loss to report, on either engine
        assert not any("moe_aux_loss" in r for r in a + b)


def test_the_losses_join_the_gradient_and_report_what_balancing_measures(runs):
    """With the losses, the first step's gradient is not the plain model's (the routers' share of it), the curve moves
    away from the unbalanced one; the reported losses sit near 1 (an even load) and above it."""
    plain, aux = runs["torchtitan-none"], runs["torchtitan"]
    assert plain[0]["loss"] == pytest.approx(aux[0]["loss"], rel=1e-7)  # the same weights and batch
    assert aux[0]["grad_norm"] > 1.5 * plain[0]["grad_norm"]
    assert abs(aux[-1]["loss"] - plain[-1]["loss"]) > 100 * LOSS_RTOL * plain[-1]["loss"]
    assert not any("moe_aux_loss" in r or "moe_seq_aux_loss" in r for r in plain)
    for r in aux:
        assert 1.0 <= r["moe_aux_loss"] < 2.0 and 1.0 <= r["moe_seq_aux_loss"] < 2.0, r


# megatron-core 0.16.1's TopKRouter methods on one rank (a gloo group of 1) against core's functions, on the same
# logits: the values its tracker records (the loss before the coefficient)
_DEFINITIONS = """
import functools, json, types
import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker, compute_routing_scores_for_aux_loss, get_moe_layer_wise_logging_tracker)
from megatron.core.transformer.moe.router import TopKRouter
from primus.core.run.balancing import balancing_scores, batch_loss, sequence_loss

def megatron(logits, k, score):  # logits [s, b, E], megatron's order
    s, b, e = logits.shape
    router = types.SimpleNamespace(
        topk=k, layer_number=1, calculate_per_token_loss=False, routing_type=["aux_loss", "seq_aux_loss"],
        tp_cp_group=dist.group.WORLD,
        config=types.SimpleNamespace(num_moe_experts=e, moe_router_fusion=False, num_layers=1, mtp_num_layers=None,
                                     moe_aux_loss_coeff=[1.0, 1.0]))
    for name in ("get_aux_loss_coeff", "attach_and_log_load_balancing_loss", "_apply_aux_loss", "_apply_seq_aux_loss"):
        setattr(router, name, functools.partial(getattr(TopKRouter, name), router))
    routing_map, scores = compute_routing_scores_for_aux_loss(logits.reshape(-1, e), k, score)
    clear_aux_losses_tracker()
    probs = torch.zeros(s * b, e)
    router._apply_aux_loss(probs, scores, routing_map)
    router._apply_seq_aux_loss(probs, scores, routing_map, s, b)
    tracked = get_moe_layer_wise_logging_tracker()
    return [float(tracked[key]["values"][0]) for key in ("load_balancing_loss", "seq_load_balancing_loss")]

dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
out = []
for score in ("softmax", "sigmoid"):
    for b, s, e, k in ((3, 16, 8, 2), (2, 64, 16, 4)):
        logits = torch.randn(b, s, e, generator=torch.Generator().manual_seed(b * s + k)) * 2
        scores, routed = balancing_scores(logits.reshape(-1, e), k, score)
        core = [float(batch_loss(scores, routed, k)), float(sequence_loss(scores, routed, k, s))]
        out.append([score, core, megatron(logits.transpose(0, 1).contiguous(), k, score)])
print(json.dumps(out))
"""


def test_cores_definition_is_megatrons():
    """Core's batch-wise and sequence-wise losses equal megatron-core's ``aux_loss`` and ``seq_aux_loss`` (what
    primus-megatron maps ``balancing: aux_loss`` and ``seq_aux_loss_coeff`` to) on the same logits, softmax and
    sigmoid scores, in a child process (no engine in the pytest process)."""
    proc = subprocess.run([sys.executable, "-c", _DEFINITIONS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(cases) == 4
    for score, core, megatron in cases:
        assert core == pytest.approx(megatron, rel=1e-6), score
        assert core[0] != pytest.approx(core[1], rel=1e-3), score  # the two losses are not one number


def test_tiny_qwen3_moe_trains_on_torchtitan(tmp_path):
    """The preset as it is (balancing: aux_loss, coefficient 1e-3), which TorchTitan refused before it had the loss."""
    primus("train", "tiny-qwen3-moe", "backend.name=torchtitan", "train.steps=3", f"logging.output_dir={tmp_path}")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-1] == 3
    assert all(math.isfinite(r["loss"]) and 1.0 <= r["moe_aux_loss"] < 2.0 for r in rows), rows
