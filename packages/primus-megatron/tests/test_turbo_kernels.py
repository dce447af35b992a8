"""primus-turbo's Triton kernels in the megatron backend against megatron's own modules, on the CPU.

The same seed weights and data trained twice at world size 1 in fp32: with core's providers (megatron's
RoPE, output layer and vocab-parallel cross-entropy) and with turbo's Triton rms_norm, swiglu, RoPE
(:mod:`primus.megatron.rope`) and fused output projection + cross-entropy (:mod:`primus.megatron.gpt`),
run by Triton's interpreter. The losses must agree to 1e-5 (relative) and the grad norms to 1e-4: the
same math in fp32, differing only in summation order (chunked GEMMs, online logsumexp).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_helpers import TINY, free_port, losses, read_metrics

pytest.importorskip("triton")

DRIVER = str(Path(__file__).parent / "turbo_on_cpu.py")
TURBO = [f"kernels.{op}=triton" for op in ("rms_norm", "swiglu", "rope", "cross_entropy")]


def train(out: Path, *overrides: str, turbo: bool) -> list[dict]:
    script = [DRIVER] if turbo else ["-m", "primus.core.cli.app"]
    # One step of a 2-layer model at global batch 4 (every kernel's forward in the loss, its backward in the grad
    # norm), at a tenth of the 4-layer, 3-step, batch-8 run's cost under Triton's interpreter (426 s on a busy
    # CI-like machine)
    small = ["train.steps=1", "model.num_layers=2", "train.global_batch_size=4", "train.schedule.warmup_steps=0"]
    cmd = [sys.executable, *script, "train", TINY, f"logging.output_dir={out}", *small, *overrides]
    cmd += ["--nproc-per-node", "1", "--master-port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PRIMUS_LAUNCHED")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**env, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return read_metrics(out)


def test_turbo_kernels_give_megatrons_loss(tmp_path):
    seed = tmp_path / "seed"
    ref = train(tmp_path / "core", f"train.save_initial={seed}", turbo=False)
    got = train(tmp_path / "turbo", f"train.init_from={seed}", *TURBO, turbo=True)
    applied = json.loads((tmp_path / "turbo" / "summary.json").read_text())["kernels_applied"]
    assert applied == {"rope": "triton provider", "output_loss": "triton fused linear + cross-entropy"}
    core = json.loads((tmp_path / "core" / "summary.json").read_text())["kernels_applied"]
    assert "megatron's" in core["rope"] and "megatron's own" in core["output_loss"]
    assert losses(got) == pytest.approx(losses(ref), rel=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4)
