"""Auxiliary-loss balancing on TorchTitan (primus.torchtitan.balancing): core's losses (primus.core.run.balancing) from
each router gate's logits, attached to the graph with the routed micro-batch's share of the step's gradient, and
``moe_aux_loss`` / ``moe_seq_aux_loss`` reported as megatron reports them.

On one MoE layer: the gate's gradient gains exactly ``share × coeff × ∇loss``; the reported values are core's losses
of the logits, averaged over the routed micro-batches; evaluation adds nothing; a pipeline stage's shape inference
joins the graph but not the sums. Trained: EP 2 × FSDP 2, TP 2 (every TP rank routes the whole micro-batch, the
gate's gradient summed over TP), PP 2 (its gradients rescaled by the global token count after the step; the shape
inference at the first step and again after each evaluation) and CP 2 × EP 2 (each rank half of every sequence: the
counts summed over CP) train world size 1's curve, losses and aux losses, with both losses on (coefficients 1.0 and
0.5: a step-1 grad norm of 3.17 against 1.81 without, so a share off by a rank moves it). The engines' equality is
tests/test_moe_balancing_same_run.py's.

Measured (fp32, CPU, 4 steps, an evaluation every 2): every layout's losses within 6.2e-8 relative of one rank's,
grad norms within 3.7e-7, aux losses within 1.9e-7 (PP 2 bit-equal).
"""

from __future__ import annotations

import pytest
import torch
from conftest import CONFIGS, metrics, primus_train

from primus.core.launch.resolve import resolve
from primus.core.run.balancing import balancing_scores, batch_loss, sequence_loss

MOE = str(CONFIGS / "tiny_moe.yaml")
AUX = ("model.moe.aux_loss_coeff=1.0", "model.moe.seq_aux_loss_coeff=0.5")
LOSS_RTOL, GNORM_RTOL, AUX_RTOL = 1e-5, 1e-3, 1e-5
STEPS = 4
# one rank's run, and each layout's overrides and ranks
LAYOUTS = {
    "ep2": (["parallel.dp_shard=2", "parallel.ep=2"], 2),
    "tp2": (["parallel.tp=2"], 2),
    "pp2": (["parallel.pp=2"], 2),
    "cp2_ep2": (["parallel.cp=2", "parallel.ep=2"], 2),
}


def _cfg(*overrides: str):
    return resolve(MOE, ["model.moe.balancing=aux_loss", *AUX, *overrides], 1).config


def _layer(cfg):
    """torchtitan's MoE layer of the test model (one), its weights drawn, and an input batch of one micro-batch."""
    from torchtitan.models.moe.moe import MoE

    from primus.torchtitan.models import moe_args

    args = moe_args(cfg.model)
    torch.manual_seed(0)
    moe = MoE(args["moe_args"], dim=cfg.model.hidden_size, hidden_dim=args["moe_inter_dim"])
    with torch.no_grad():
        moe.init_weights(0.5, torch.device("cpu"))
    x = torch.randn(cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.hidden_size)
    return moe, x


def _gate_grad(moe, x) -> torch.Tensor:
    moe.zero_grad()
    moe(x).square().mean().backward()
    return moe.router.gate.weight.grad.clone()


def test_gate_gradient_gains_the_losses_share_and_metrics_are_cores_losses():
    from primus.torchtitan.balancing import Balancing

    cfg = _cfg()
    moe, x = _layer(cfg)
    plain = _gate_grad(moe, x)
    balancing = Balancing(cfg, [(0, moe.router, None)], "cpu")
    assert balancing.coeffs == {"aux_loss": 1.0, "seq_aux_loss": 0.5}
    balancing.set_layout(tp=1)
    assert balancing.grad_scale == pytest.approx(2 / 8)  # a micro-batch of 2 of the global batch's 8 samples
    got = _gate_grad(moe, x)

    # what the hook must add: ∇(share × Σ coeff × loss) through the gate, from core's functions of its logits
    weight = moe.router.gate.weight.detach().requires_grad_(True)
    logits = x.reshape(-1, x.shape[-1]) @ weight.T
    scores, routed = balancing_scores(logits, 2, "softmax")
    aux, seq = batch_loss(scores, routed, 2), sequence_loss(scores, routed, 2, cfg.train.seq_len)
    (expected,) = torch.autograd.grad(balancing.grad_scale * (1.0 * aux + 0.5 * seq), weight)
    assert float((got - plain - expected).abs().max()) < 1e-3 * float(expected.abs().max())  # fp32 roundoff
    assert float(expected.abs().max()) > 1e-3 * float(plain.abs().max())  # a gradient the test can see

    # two forwards in the interval, the second on another batch: the metrics are their means
    x2 = torch.randn_like(x)
    moe(x2).sum().backward()
    scores2, routed2 = balancing_scores(x2.reshape(-1, x.shape[-1]) @ weight.detach().T, 2, "softmax")
    want = {
        "moe_aux_loss": (float(aux) + float(batch_loss(scores2, routed2, 2))) / 2,
        "moe_seq_aux_loss": (float(seq) + float(sequence_loss(scores2, routed2, 2, cfg.train.seq_len))) / 2,
    }
    assert balancing.metrics() == pytest.approx(want, rel=1e-6)
    assert balancing.metrics() == {}  # a new interval, nothing routed yet
    balancing.close()


def test_layouts_scale_the_losses_share():
    """TP: every TP rank routes the micro-batch and the gate's gradient is summed over them; PP: the trainer divides
    every gradient by the global token count after the step (compat.pp_grad_scale)."""
    from primus.torchtitan.balancing import Balancing
    from primus.torchtitan.compat import pp_grad_scale

    balancing = Balancing(_cfg(), [], "cpu")
    balancing.set_layout(tp=2)
    assert balancing.grad_scale == pytest.approx(2 / 8 / 2)
    balancing.set_layout(tp=1, pp_grad_scale=pp_grad_scale(512.0))
    assert balancing.grad_scale == pytest.approx(2 / 8 * 512)


def test_no_loss_without_gradients_and_shape_inference_joins_only_the_graph():
    from primus.torchtitan.balancing import Balancing

    cfg = _cfg()
    moe, x = _layer(cfg)
    plain = _gate_grad(moe, x)
    balancing = Balancing(cfg, [(0, moe.router, None)], "cpu", pipeline=True)
    with torch.no_grad():  # an evaluation
        moe(x)
    moe.eval()
    moe(x)
    moe.train()
    assert balancing.metrics() == {}
    assert balancing.inferring == {0}  # still waiting for the stage's shape inference
    inferred = _gate_grad(moe, x)  # the shape inference: the loss is in its graph, not in the sums
    assert not torch.allclose(inferred, plain)
    assert balancing.metrics() == {} and balancing.inferring == set()
    _gate_grad(moe, x)
    assert set(balancing.metrics()) == {"moe_aux_loss", "moe_seq_aux_loss"}
    balancing.shape_inference()  # after an evaluation the schedule infers again
    assert balancing.inferring == {0}


def test_no_auxiliary_loss_no_balancing():
    from primus.torchtitan.balancing import coefficients

    assert coefficients(resolve(MOE, [], 1).config) == {}  # loss_free
    assert coefficients(_cfg("model.moe.aux_loss_coeff=0")) == {"seq_aux_loss": 0.5}
    assert coefficients(_cfg("model.moe.balancing=none", "model.moe.seq_aux_loss_coeff=0")) == {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan_balancing")
    common = ("model.moe.balancing=aux_loss", *AUX, f"train.steps={STEPS}")
    common += ("eval.interval=2", "eval.batches=1", "eval.holdout=0.05")  # PP infers its shapes again after each
    primus_train(MOE, root / "ws1", *common)
    for name, (overrides, nproc) in LAYOUTS.items():
        primus_train(MOE, root / name, *common, *overrides, nproc=nproc)
    return {name: metrics(root / name) for name in ("ws1", *LAYOUTS)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_one_ranks_curve_with_the_aux_losses(runs, layout):
    ref, got = runs["ws1"], runs[layout]
    assert len(got) == STEPS and any("eval_loss" in r for r in got)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=LOSS_RTOL)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=GNORM_RTOL)
    for key in ("moe_aux_loss", "moe_seq_aux_loss"):  # every step: PP's shape inference is not counted
        assert [r[key] for r in got] == pytest.approx([r[key] for r in ref], rel=AUX_RTOL), key
