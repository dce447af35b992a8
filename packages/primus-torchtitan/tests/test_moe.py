"""Mixture-of-experts on TorchTitan: torchtitan 0.2.2's qwen3 MoE (a top-k router with the weight applied to each
expert's output, as Megatron-Core does; loss-free balancing by its expert-bias update) from ``model.moe``, its experts
on primus-turbo's grouped_mm (ProviderGroupedExperts) or torchtitan's own (a loop on CPU): the same curve.

From core's canonical initial weights (routers and experts by their Hugging Face names), a tiny Qwen3-MoE trains;
2 ranks with FSDP2 and expert parallelism 2 (each rank holds half the experts, the tokens exchanged all-to-all)
train world size 1's loss curve and gradient norms (measured: FSDP2 alone equals it too), as do TP 2, PP 2,
TP 2 x EP 2 x FSDP 2 and CP 2 x EP 2; world size 1's step-3 checkpoint resumed under expert parallelism 2 continues its curve.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import CONFIGS, drive, metrics, primus_train, summary

MOE = str(CONFIGS / "tiny_moe.yaml")
# fp32. Losses agree to 1e-7; a step's gradient norm can move by up to 4.6e-4 (the bundled corpus as a clean interpreter
# walks it: step 6 of every layout, the other steps within 3e-5): 1e-3, as test_train allows, still tells a gradient
# summed in another order from a wrong one (a reduction left out is off by a whole rank's share)
LOSS_RTOL, GNORM_RTOL = 1e-5, 1e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan_moe")
    # torchtitan's own experts (core's reference grouped_gemm) here; primus-turbo's grouped_mm under EP (auto)
    primus_train(MOE, root / "ws1", "checkpoint.enabled=true", "checkpoint.interval=3", "kernels.grouped_gemm=torch")
    primus_train(MOE, root / "ep2", "parallel.dp_shard=2", "parallel.ep=2", nproc=2)
    primus_train(MOE, root / "ep4", "parallel.dp_shard=4", "parallel.ep=4", nproc=4)  # 2 of the 8 experts a rank
    primus_train(MOE, root / "tp2", "parallel.tp=2", nproc=2)
    primus_train(MOE, root / "pp2", "parallel.pp=2", nproc=2)
    primus_train(MOE, root / "tp2_ep2", "parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2", nproc=4)
    primus_train(MOE, root / "cp2_ep2", "parallel.cp=2", "parallel.ep=2", nproc=2)  # EP borrows the CP ranks
    # primus-turbo's Triton router and permute / unpermute (Triton's interpreter on the CPU) under EP 2 (the tokens
    # handed over by the all-to-all), loss-free balancing's expert bias choosing
    triton = {"PRIMUS_TEST_TRITON_ON_CPU": "1", "TRITON_INTERPRET": "1"}
    torch_ops = [f"kernels.{op}=torch" for op in ("rms_norm", "swiglu", "cross_entropy")]
    # 2 steps (the interpreter takes 12 s a step): the second routed by the expert bias the first updated
    moe_ops = ("kernels.moe_permute=triton", "kernels.moe_router=triton", "train.steps=2")
    moe_ops += ("train.schedule.decay_steps=6",)  # world size 1's schedule: its first 2 steps
    proc = drive(
        MOE, root / "turbo_moe_ep2", *moe_ops, "parallel.dp_shard=2", "parallel.ep=2", *torch_ops, env=triton, nproc=2
    )
    ckpt = root / "ckpt"
    ckpt.mkdir()
    shutil.copytree(root / "ws1" / "checkpoints" / "step_00000003", ckpt / "step_00000003")
    resume = (f"checkpoint.dir={ckpt}", "checkpoint.enabled=true", "parallel.dp_shard=2", "parallel.ep=2")
    primus_train(MOE, root / "ep2_resume", *resume, nproc=2, resume=True)
    names = ("ws1", "ep2", "ep4", "ep2_resume", "tp2", "pp2", "tp2_ep2", "cp2_ep2", "turbo_moe_ep2")
    out = {name: metrics(root / name) for name in names}
    out["turbo_moe_kernels"] = summary(proc)["kernels"]
    out["experts"] = {name: json.loads((root / name / "summary.json").read_text())["kernels"]["grouped_gemm"]
                      for name in ("ws1", "ep2")}  # fmt: skip
    return out


def test_experts_run_on_the_grouped_gemm_provider_or_torchtitans_own(runs):
    assert runs["experts"] == {"ws1": "torchtitan", "ep2": "grouped_mm"}


def test_moe_model_trains(runs):
    curve = [r["loss"] for r in runs["ws1"]]
    assert len(curve) == 6 and curve[-1] < curve[0] - 0.2, curve


def test_expert_parallel_2_matches_world_size_1(runs):
    ref, got = runs["ws1"], runs["ep2"]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=LOSS_RTOL)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=GNORM_RTOL)
    # the routers' expert load, summed over the two ranks' tokens
    for key in ("moe_load_max", "moe_load_min"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in ref], rel=1e-6), key


@pytest.mark.parametrize("layout", ["ep4", "tp2", "tp2_ep2", "pp2", "cp2_ep2"])
def test_other_layouts_match_world_size_1(runs, layout):
    """EP 4 × FSDP 4 (2 experts a rank), TP 2 (the experts tensor-parallel, the router's gradient reduced over TP: compat.router_gate_partial_grad;
    without it the gate weights part across ranks from step 1), TP 2 x EP 2 x FSDP 2 (4 ranks, the experts
    tensor-parallel inside each expert-parallel group), PP 2 (one MoE layer per stage) and CP 2 x EP 2 (each rank
    half of every sequence, ring attention; the experts split over the same two ranks, torchtitan's EP borrowing the
    CP dimension; the expert load summed over both halves)."""
    ref, got = runs["ws1"], runs[layout]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=LOSS_RTOL)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=GNORM_RTOL)
    # from step 2: torch's pipeline stages run one extra forward at their first step (shape inference), which the
    # routers' counts see
    first = 1 if layout == "pp2" else 0
    for key in ("moe_load_max", "moe_load_min"):
        assert [r[key] for r in got[first:]] == pytest.approx([r[key] for r in ref[first:]], rel=1e-6), key


def test_triton_router_and_permute_train_the_same_curve(runs):
    """ProviderRouter and ProviderMoE: the router's scores and top-k, the tokens' gather and the weighted combine by
    primus-turbo's Triton kernels, under EP 2: world size 1's curve, gradient norms and expert load."""
    kernels = runs["turbo_moe_kernels"]
    assert (kernels["moe_router"], kernels["moe_permute"]) == ("triton", "triton")
    ref, got = runs["ws1"][:2], runs["turbo_moe_ep2"]
    assert len(got) == 2
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=LOSS_RTOL)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=GNORM_RTOL)
    assert [r["moe_load_max"] for r in got] == pytest.approx([r["moe_load_max"] for r in ref], rel=1e-6)


def test_world_size_1_checkpoint_resumes_under_expert_parallelism(runs):
    rows = runs["ep2_resume"]
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in runs["ws1"][3:]], rel=LOSS_RTOL)
