from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from primus.core.launch.env import free_port
from primus.core.run.testing import built_once
from primus.torchtitan import compat

compat.import_torchtitan()  # before any test module imports torchtitan (CPU adaptations)

CONFIGS = Path(__file__).parent / "configs"
TINY = str(CONFIGS / "tiny.yaml")


def primus_train(
    config: str,
    out: Path,
    *overrides: str,
    nproc: int = 1,
    resume: bool = False,
    timeout: int = 240,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``primus train`` in a fresh process (torchrun for several), output in ``out``; fails the test on
    error if ``check``."""
    cmd = [
        sys.executable,
        "-m",
        "primus.core.cli.app",
        "train",
        config,
        f"logging.output_dir={out}",
        *overrides,
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
    ]
    if resume:
        cmd.append("--resume")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PRIMUS_LAUNCHED")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        (out / "failed-run.log").write_text(proc.stdout + proc.stderr)
        errors = [line for line in proc.stderr.splitlines() if "rror" in line and "lspci" not in line]
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode} (full log: {out}/failed-run.log):\n"
            + "\n".join(errors[-30:])
            + f"\n...\n{proc.stderr[-3000:]}"
        )
    return proc


DRIVE = str(Path(__file__).parent / "drive.py")


def drive(
    config: str,
    out: Path,
    *overrides: str,
    env: dict[str, str],
    nproc: int = 1,
    command: str = "train",
    check: bool = True,
    timeout: int = 240,
) -> subprocess.CompletedProcess:
    """``primus COMMAND`` through ``drive.py`` (test-only changes in the training process, chosen by
    ``env``; see drive.py), under torchrun for several processes. Fails the test on error if ``check``."""
    args = [DRIVE, command, config, f"logging.output_dir={out}", *overrides]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}", *args]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PRIMUS_LAUNCHED")}
    if nproc > 1:
        base["PRIMUS_LAUNCHED"] = "1"
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env={**base, **env})
    if check and proc.returncode != 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "failed-run.log").write_text(proc.stdout + proc.stderr)
        pytest.fail(
            f"{' '.join(args)} exited {proc.returncode} (full log: {out}/failed-run.log):\n{proc.stderr[-4000:]}"
        )
    return proc


def summary(proc: subprocess.CompletedProcess) -> dict:
    """The run summary ``primus train`` prints last (``done: {...}``)."""
    line = next(line for line in reversed(proc.stderr.splitlines()) if line.startswith("done: "))
    return json.loads(line.removeprefix("done: "))


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [row["loss"] for row in metrics(out)]


def _key(overrides: tuple[str, ...]) -> str:
    return hashlib.sha1(repr(overrides).encode()).hexdigest()[:10]


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory) -> callable:
    """One seed checkpoint per model config (core's ``train.save_initial`` of a one-step run at world size 1),
    loaded by every layout (``train.init_from``) so they all start from the same weights."""

    def get(*overrides: str) -> str:
        def build(out: Path) -> None:
            primus_train(TINY, out / "run", *overrides, f"train.save_initial={out / 'seed'}", "train.steps=1")

        return str(built_once(tmp_path_factory, f"seed-{_key(overrides)}", build) / "seed")

    return get


@pytest.fixture(scope="session")
def reference(tmp_path_factory, seed_checkpoint):
    """World size 1 from the seed checkpoint, per model (8 steps)."""

    def get(model: tuple[str, ...]) -> Path:
        seed = seed_checkpoint(*model)
        build = lambda out: primus_train(TINY, out, *model, f"train.init_from={seed}")  # noqa: E731
        return built_once(tmp_path_factory, f"ws1-{_key(model)}", build)

    return get


@pytest.fixture(scope="session")
def fsdp2_straight(tmp_path_factory, seed_checkpoint):
    """2 ranks (FSDP dp_shard 2) from the seed checkpoint, 8 steps uninterrupted, a checkpoint every 2 steps
    (all kept): the reference of the resume and crash-safety tests, and the FSDP 2 layout's run (test_train)."""
    overrides = (
        f"train.init_from={seed_checkpoint()}",
        "parallel.dp_shard=2",
        "checkpoint.interval=2",
    )
    build = lambda out: primus_train(TINY, out, *overrides, "checkpoint.keep_last=4", nproc=2)  # noqa: E731
    out = built_once(tmp_path_factory, "fsdp2", build)
    return {"out": out, "overrides": overrides, "losses": losses(out), "rows": metrics(out)}
