"""Helpers for the megatron backend tests: run ``primus train`` in a subprocess, read its losses.

Training always runs in a child process: megatron's CPU redirection patches torch globally, and
multi-rank runs go through core's launcher (torch.distributed.run) anyway.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from primus.core.launch.env import free_port
from primus.core.run.testing import built_once

CONFIGS = Path(__file__).parent / "configs"
TINY = str(CONFIGS / "tiny.yaml")

# fp32 on CPU: layouts differ only in reduction order (all-reduce of partial sums, sharded matmuls).
# Measured differences are below 1e-6; this bound leaves room for other BLAS builds.
LOSS_TOL = 1e-4


# The start of a child-process script that builds megatron models in one process: the CPU redirection, a one-rank gloo
# group, megatron's parallel state and its seed (it draws weights under its model-parallel RNG); then `reg`, the
# kernel registry. Each script goes on from there.
ONE_RANK_SCRIPT = """
import socket, sys
import torch
import torch.distributed as dist
from primus.megatron.cpu import redirect_to_cpu
redirect_to_cpu()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
from primus.core.config.presets import model_config
from primus.core.config.schema import PrimusConfig
from primus.core.contracts.plugins import get_registry
from primus.megatron.dist import init_parallel, seed
init_parallel(1, 1, 1, 1)
seed(0)
reg = get_registry()
"""


def primus(
    command: str, config: str, out: Path, nproc: int = 1, *overrides: str, resume: bool = False, timeout: int = 240
) -> subprocess.CompletedProcess:
    """Run ``primus COMMAND CONFIG logging.output_dir=OUT ...`` (through core's launcher for nproc > 1)."""
    cmd = [
        sys.executable,
        "-m",
        "primus.core.cli.app",
        command,
        config,
        f"logging.output_dir={out}",
        *overrides,
        "--nproc-per-node",
        str(nproc),
    ]
    if command in ("train", "profile"):
        cmd += ["--master-port", str(free_port())]
    if resume:
        cmd.append("--resume")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PRIMUS_LAUNCHED")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train(
    config: str, out: Path, nproc: int = 1, *overrides: str, resume: bool = False, timeout: int = 240
) -> list[dict]:
    """Run ``primus train`` and return the metrics rows of ``out/metrics.jsonl``."""
    proc = primus("train", config, out, nproc, *overrides, resume=resume, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return read_metrics(out)


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """World size 1 on the tiny config; writes the seed checkpoint every other layout loads and a
    full checkpoint at step 3 (for the resume tests)."""

    def build(root: Path) -> None:
        train(TINY, root / "ws1", 1, f"train.save_initial={root / 'seed'}", "checkpoint.enabled=true",
              "checkpoint.interval=3")  # fmt: skip

    root = built_once(tmp_path_factory, "megatron_ref", build)
    rows = read_metrics(root / "ws1")
    return {"seed": root / "seed", "out": root / "ws1", "rows": rows, "losses": losses(rows)}


# bf16 compute (fp32 master weights) from core's canonical weights, the reference's too; the FP8 recipe's keys are
# inert with kernels.fp8 off, and FP8's runs take the same ones
BF16 = ("train.precision=bf16", "kernels.fp8_recipe.bf16_last_layers=1", "kernels.fp8_recipe.linears=all")


@pytest.fixture(scope="session")
def bf16_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One bf16 run for the tests that compare with one (bf16 against fp32, FP8 against bf16)."""
    return read_metrics(built_once(tmp_path_factory, "megatron_bf16", lambda out: train(TINY, out, 1, *BF16)))


# 2 ranks, default split (dp_shard = 2: the distributed optimizer), parameter all-gathers overlapping
# the forward (a save must wait for the gathered weights), checkpoints at steps 2, 4, 6.
DP2_CKPT = [
    "parallel.overlap_grad_reduce=true",
    "parallel.overlap_param_gather=true",
    "checkpoint.enabled=true",
    "checkpoint.interval=2",
]


@pytest.fixture(scope="session")
def dp2_straight(reference: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted 6-step run on 2 ranks from the reference's seed weights (keep_last 2)."""
    overrides = [f"train.init_from={reference['seed']}", *DP2_CKPT]
    out = built_once(tmp_path_factory, "megatron_dp2", lambda root: train(TINY, root / "straight", 2, *overrides))
    rows = read_metrics(out / "straight")
    return {"out": out / "straight", "rows": rows, "losses": losses(rows), "overrides": overrides}
