"""GPT-OSS (issue 53, the planning slice): Primus plans gpt-oss-20b / gpt-oss-120b and no engine builds them yet.
Each installed engine refuses family gpt_oss in one issue at ``model.family`` naming what it lacks (megatron: its
local layer spec has no attention sinks nor sliding-window attention; torchtitan: Primus's adapter does not build
torchtitan's gpt_oss model); ``primus train`` stops with exit 2 before writing anything; ``primus plan`` prints the
memory and time of every layout and says the engine refuses them (exit 3 where none fits, 4 where some fit), and
``--engine generic`` plans the model engine-free. Core's counts: primus-core's tests/test_gpt_oss.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from primus.core.cli import app as cli
from primus.core.planner.engine_profile import backend_spec

ENGINES = ("megatron", "torchtitan")
LACKS = {
    "megatron": "has no attention sinks and no sliding-window attention",
    "torchtitan": "Primus's torchtitan adapter does not build torchtitan 0.2.2's gpt_oss model",
}


def _engine(name: str):
    spec = backend_spec(name)
    if spec is None or spec.validate is None:
        pytest.skip(f"backend {name!r} is not installed")
    return spec


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one line per layout


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "gpt-oss-20b", "gpt-oss-120b"])
def test_engine_refuses_it_by_name(backend, preset):
    from primus.core.config.errors import ConfigError
    from primus.core.config.presets import model_config
    from primus.core.config.validate import validate_config
    from primus.core.contracts.plugins import get_registry

    _engine(backend)
    model = model_config(preset, get_registry()).model_dump(mode="json")
    with pytest.raises(ConfigError) as info:
        validate_config({"model": model, "backend": {"name": backend}}, world_size=1, registry=get_registry())
    (issue,) = info.value.issues  # one: what the engine lacks, in place of core's generic "cannot run" line
    assert (issue.path, issue.value) == ("model.family", "gpt_oss")
    assert LACKS[backend] in issue.message and "training them and their Hugging Face import" in issue.message


@pytest.mark.parametrize("backend", ENGINES)
def test_train_stops_before_writing_anything(tmp_path, backend):
    _engine(backend)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "primus.core.cli.app", "train", "gpt-oss-20b", f"backend.name={backend}"]
        + [f"logging.output_dir={out}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, PRIMUS_CACHE=str(tmp_path / "cache")),
        timeout=300,
    )
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, text
    assert "model.family: " + backend + " cannot build GPT-OSS models yet" in text and LACKS[backend] in text, text
    assert "Traceback" not in text
    assert not out.exists() and {p.name for p in tmp_path.iterdir()} <= {"cache"}, sorted(tmp_path.iterdir())


def test_plan_of_the_120b_on_one_and_two_nodes():
    """Its fp32 master weights, gradients and Adam state (16 bytes a parameter, 1.87 TB) fit no layout of 8 or 16
    H100s: the table is printed (every layout's memory and time), the engine's refusal noted, exit 3."""
    _engine("torchtitan")
    for nodes in ("1", "2"):
        run = CliRunner().invoke(cli.app, ["plan", "gpt-oss-120b", "--device", "H100", "--gpus", "8", "--nodes", nodes])
        assert run.exit_code == 3, run.output
        assert f"gpt-oss-120b on {nodes}×8 H100" in run.output and "FSDP" in run.output
        said = " ".join(run.output.split())
        assert (
            "note: torchtitan refuses every layout, whatever its memory: model.family: torchtitan cannot build" in said
        )
        assert "error: nothing fits" in said and "recommended" not in said


def test_plan_where_layouts_fit():
    """gpt-oss-20b fits 8 H100s: the engine refuses every layout that fits, by name (exit 4); core's generic engine
    plans it and recommends one."""
    _engine("torchtitan")
    run = CliRunner().invoke(cli.app, ["plan", "gpt-oss-20b", "--device", "H100", "--gpus", "8"])
    said = " ".join(run.output.split())
    assert run.exit_code == 4, run.output
    assert "error: torchtitan refuses every layout that fits: model.family: torchtitan cannot build GPT-OSS" in said
    generic = CliRunner().invoke(
        cli.app, ["plan", "gpt-oss-20b", "--device", "H100", "--gpus", "8", "--engine", "generic"]
    )
    assert generic.exit_code == 0, generic.output
    assert "recommended: " in generic.output
