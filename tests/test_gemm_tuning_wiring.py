"""GEMM tuning reaches both engines' training loops through the plugin hooks (issue #11).

primus-tune implements ``primus_on_model_ready`` (set tuning up, route the model's linears through tuned GEMMs),
``primus_on_optimizer_step`` (online search after each step) and ``primus_on_train_end`` (results written). On a CPU
the real searchers cannot run, so ``tune_driver.py`` fakes "offline on CUDA" with a plan for every shape that
computes in float64: the run must route every linear GEMM (forward, input grad, weight grad) through the plans,
call the per-step hook on every step, and train to the same losses as an untuned run (fp32; the float64 GEMMs
differ from torch's in the last bits only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import primus

DRIVER = Path(__file__).parent / "fixtures" / "tune_driver.py"
COMMON = [
    "train.steps=4",
    "train.schedule.warmup_steps=1",
    "logging.interval=1",
    "train.precision=fp32",
    "logging.tensorboard=false",
    "logging.progress=false",
    "checkpoint.enabled=false",
]
RECIPES = {"torchtitan": "tiny-demo", "megatron": "tiny-demo-megatron"}


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("backend", sorted(RECIPES))
def test_tuned_gemms_run_every_linear_and_train_like_untuned(backend, tmp_path):
    log = tmp_path / "tune.json"
    tuned_out, plain_out = tmp_path / "tuned", tmp_path / "plain"
    env = {**os.environ, "PRIMUS_TEST_TUNE_LOG": str(log)}
    args = ["train", RECIPES[backend], *COMMON]
    proc = subprocess.run(
        [sys.executable, str(DRIVER), *args, f"logging.output_dir={tuned_out}", "kernels.gemm_tuning=offline"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    primus(*args, f"logging.output_dir={plain_out}")

    record = json.loads(log.read_text())
    assert record["steps"] == [1, 2, 3, 4]
    # tiny-llama: 2 layers x (q, k, v, o or fused qkv, o; gate, up, down or fused fc1, fc2) + output head
    assert record["patched"] >= 2 * 4 + 1
    kinds = {key.split(":")[0] for key in record["hits"]}
    layouts = {key for key in record["hits"]}
    assert record["summary"]["mode"] == "offline"
    assert len(layouts) >= 3 and kinds, record["hits"]  # forward, input-grad and weight-grad GEMMs all routed
    tuned, plain = _losses(tuned_out), _losses(plain_out)
    assert len(tuned) == 4 and tuned[-1] < tuned[0]
    assert tuned == pytest.approx(plain, rel=1e-5)


def test_gemm_tuning_on_cpu_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    proc = primus("train", "tiny-demo", *COMMON, f"logging.output_dir={out}", "kernels.gemm_tuning=online", check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: invalid config:\n  - kernels.gemm_tuning: GEMM tuning needs a GPU")
    assert "(got 'online'); allowed: off on a CPU" in proc.stderr
    assert not out.exists()  # refused by primus-tune's primus_check_run, before the run folder
