"""A third-party plugin, built and installed like any distribution, shows up everywhere and can be used."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import primus

FIXTURE = Path(__file__).parent / "fixtures" / "primus-example-plugin"
DIST = "primus-example-plugin"


def pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True, capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def example_plugin(tmp_path_factory):
    """Build and install the fixture into this environment; uninstall it afterwards.

    No build isolation and no dependencies: hatchling and primus-core are already installed here, so this
    works offline."""
    src = tmp_path_factory.mktemp("src") / "primus-example-plugin"
    shutil.copytree(FIXTURE, src)
    pip("install", "--no-deps", "--no-build-isolation", str(src))
    try:
        yield
    finally:
        pip("uninstall", "--yes", DIST)


def test_backend_kernel_and_presets_are_listed(example_plugin):
    rows = {ln.split()[0]: ln for ln in primus("plugins").stdout.splitlines() if ln.strip()}
    row = rows["example"]
    assert DIST in row and " ok " in row
    assert "backends: example" in row and "kernels: attention:example" in row and "presets:" in row
    assert "loggers: example_log" in rows["example_log"]

    listed = primus("presets", "list").stdout
    assert any(ln.split()[:1] == ["example-tiny"] and DIST in ln for ln in listed.splitlines())


def test_its_backend_and_kernel_can_be_selected(example_plugin):
    out = primus("config", "validate", "example-tiny", "backend.name=example", "kernels.attention=example").stdout
    assert "ok: tiny-llama on backend example" in out

    refused = primus("config", "validate", "example-tiny", "--world-size", "2", check=False)
    assert refused.returncode == 2
    assert "the example backend runs in one process" in refused.stderr + refused.stdout


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_it_trains_through_primus(example_plugin, tmp_path):
    run = primus(
        "train", "example-tiny", f"logging.output_dir={tmp_path}", "logging.loggers.example_log.path=copy.jsonl"
    )
    assert "attention=example" in run.stderr
    losses = [r["loss"] for r in _rows(tmp_path)]
    assert len(losses) == 20
    assert losses[-1] < 0.5 * losses[0]
    logged = [json.loads(line) for line in (tmp_path / "copy.jsonl").read_text().splitlines()]  # its logger too
    assert [r["loss"] for r in logged[:-1]] == [r["loss"] for r in _rows(tmp_path) if "loss" in r][: len(logged) - 1]
    assert logged[-1] == {"status": "ok"}
    refused = primus("config", "validate", "example-tiny", "logging.loggers.example.project=x", check=False)
    assert refused.returncode == 2 and "plugin 'example'" in refused.stderr and "is not a logger" in refused.stderr


# The example backend writes an engine adapter only: what follows comes from core's loop (primus.core.run.loop).
CKPT = ["train.steps=6", "checkpoint.enabled=true", "checkpoint.interval=2", "checkpoint.keep_last=2"]


@pytest.fixture(scope="module")
def straight(example_plugin, tmp_path_factory):
    out = tmp_path_factory.mktemp("example") / "straight"
    primus("train", "example-tiny", f"logging.output_dir={out}", *CKPT)
    return out


def test_core_gives_it_metrics_and_the_schedule(straight):
    from primus.core.config.schema import TrainConfig
    from primus.core.run.loop import METRICS
    from primus.core.run.schedule import lr_at

    rows = _rows(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    on_cpu = set(METRICS) - {"mfu"}  # no peak FLOP/s on a CPU
    assert all(set(r) == {"step", "time", *on_cpu} for r in rows), rows[0].keys()
    cfg = json.loads(json.dumps(__import__("yaml").safe_load((straight / "config.yaml").read_text())["train"]))
    train = TrainConfig.model_validate(cfg)
    assert [r["lr"] for r in rows] == [lr_at(n, train) for n in range(1, 7)]
    assert rows[0]["tokens_per_s"] > 0 and rows[0]["memory_gib"] > 0


def test_core_gives_it_checkpoints_and_resume(straight, tmp_path):
    ckpts = straight / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004", "step_00000006"]  # keep_last 2
    man = json.loads((ckpts / "step_00000004" / "manifest.json").read_text())
    assert man["step"] == 4 and man["applied_steps"] == 4 and "primus-example-plugin" in man["versions"]
    # resume from step 4 into a new folder: steps 5 and 6 equal the straight run's
    shutil.copytree(ckpts / "step_00000004", tmp_path / "ckpt" / "step_00000004")
    primus(
        "train",
        "example-tiny",
        f"logging.output_dir={tmp_path / 'out'}",
        *CKPT,
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "--resume",
    )
    resumed, full = _rows(tmp_path / "out"), _rows(straight)
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[4:]]
    # a fresh run refuses a folder that holds checkpoints
    refused = primus(
        "train",
        "example-tiny",
        f"logging.output_dir={tmp_path / 'again'}",
        *CKPT,
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        check=False,
    )
    assert refused.returncode == 2 and "holds checkpoints of an earlier run" in refused.stderr


def test_core_gives_it_health_checks(example_plugin, tmp_path):
    skip = tmp_path / "skip"
    primus(
        "train",
        "example-tiny",
        f"logging.output_dir={skip}",
        *CKPT,
        "backend.extra.nan_at_step=3",
        "train.health.on_nonfinite=skip",
    )
    rows = _rows(skip)
    assert rows[2]["skipped_steps"] == 1 and rows[3]["lr"] == rows[2]["lr"]  # the skipped update kept its lr
    assert json.loads((skip / "checkpoints" / "step_00000004" / "manifest.json").read_text())["applied_steps"] == 3
    stop = tmp_path / "stop"
    proc = primus(
        "train", "example-tiny", f"logging.output_dir={stop}", *CKPT, "backend.extra.nan_at_step=3", check=False
    )
    assert proc.returncode != 0 and "step 3: non-finite loss" in proc.stderr
    assert json.loads((stop / "summary.json").read_text())["status"] == "failed"
    assert sorted(p.name for p in (stop / "checkpoints").iterdir()) == ["step_00000002"]
