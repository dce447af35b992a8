"""An evaluation followed by a checkpoint save, on 2 ranks of both engines: the save succeeds and a run resumed from
that checkpoint trains the uninterrupted run's curve.

An evaluation is a forward without a backward. Under FSDP2, modules torchtitan builds with
``reshard_after_forward=False`` (the norm + output group, the root) stayed unsharded after it, so the next
save's optimizer state dict met parameters the optimizer does not hold (``KeyError`` in DCP's
``_get_optim_state_dict``); the TorchTitan adapter now reshards after evaluating
(:func:`primus.torchtitan.trainer.reshard`). Checked on the dense layout (FSDP 2 / megatron's distributed
optimizer over 2 ranks) with a resume, and on mixture-of-experts layouts (TorchTitan FSDP 2 x EP 2, Megatron EP 2).
"""

from __future__ import annotations

import json
import shutil

import pytest
from hf_helpers import run_config, train

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

STEPS = 4
SAVE_AT = 2  # an evaluation, then a save, at steps 2 and 4
EVAL = {"holdout": 0.1, "interval": SAVE_AT, "batches": 1}
BACKENDS = ("megatron", "torchtitan")
MOE_LAYOUT = {"megatron": ["parallel.ep=2"], "torchtitan": ["parallel.dp_shard=2", "parallel.ep=2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eval_then_save")
    out: dict = {}
    for backend in BACKENDS:
        checkpoint = {"interval": SAVE_AT, "keep_last": 2}
        config = run_config(root / f"{backend}.yaml", backend, train={"steps": STEPS}, checkpoint=checkpoint, eval=EVAL)
        straight = root / f"{backend}-straight"
        out[backend] = train(config, straight, nproc=2)
        out[f"{backend}-folders"] = sorted(p.name for p in (straight / "checkpoints").iterdir())
        # the checkpoint saved right after step 2's evaluation, resumed in another run folder
        copy = root / f"{backend}-ckpt"
        shutil.copytree(straight / "checkpoints" / f"step_{SAVE_AT:08d}", copy / f"step_{SAVE_AT:08d}")
        resumed = root / f"{backend}-resumed"
        out[f"{backend}-resumed"] = train(config, resumed, f"checkpoint.dir={copy}", "checkpoint.resume=auto", nproc=2)

        moe = root / f"{backend}-moe"
        layout = [*MOE_LAYOUT[backend], "model.moe.balancing=none"]  # torchtitan has no auxiliary loss
        small = ["train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4"]
        evaluate = [f"eval.{k}={v}" for k, v in EVAL.items()]
        out[f"{backend}-moe"] = train(
            "tiny-qwen3-moe", moe, f"train.steps={SAVE_AT}", *small, *evaluate, *layout, nproc=2
        )
        out[f"{backend}-moe-summary"] = json.loads((moe / "summary.json").read_text())
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_evaluation_then_a_save_on_two_ranks(runs, backend):
    rows = runs[backend]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    assert runs[f"{backend}-folders"] == ["step_00000002", "step_00000004"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_run_resumed_after_it_trains_the_straight_curve(runs, backend):
    straight, resumed = runs[backend], runs[f"{backend}-resumed"]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight[SAVE_AT:]], rel=1e-6)
    assert resumed[-1]["eval_loss"] == pytest.approx(straight[-1]["eval_loss"], rel=1e-6)
    assert straight[-1]["loss"] < straight[0]["loss"]  # it trains: the equality is not of two constant curves


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_layout_saves_after_evaluating(runs, backend):
    rows, summary = runs[f"{backend}-moe"], runs[f"{backend}-moe-summary"]
    assert "eval_loss" in rows[-1] and rows[-1]["step"] == SAVE_AT
    assert summary["status"] == "ok" and summary["checkpoint"].endswith(f"step_{SAVE_AT:08d}")
