"""The CLI end to end (in process through typer's runner; one subprocess for import cost)."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from primus.core.cli import app as cli

runner = CliRunner()


def test_presets_list_shows_shapes_and_counts():
    res = runner.invoke(cli.app, ["presets", "list"])
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if line.lstrip().startswith("llama3.1-8b "))
    assert "8.03B" in row and " 32 " in row and "4096" in row and "128256" in row
    names = [ln.split()[0] for ln in res.output.splitlines() if ln.strip() and ln.split()[0].count("-") >= 1]
    assert names.index("tiny-llama") < names.index("qwen2.5-0.5b")  # tiny presets come first


def test_presets_show_and_unknown():
    res = runner.invoke(cli.app, ["presets", "show", "qwen3-8b"])
    assert res.exit_code == 0 and "qk_norm: true" in res.output
    res = runner.invoke(cli.app, ["presets", "show", "qwen3-8"])
    assert res.exit_code == 2 and "did you mean 'qwen3-8b'" in res.output


def test_config_show_names_layers(tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text("extends: [tiny-demo]\ntrain: {steps: 11}\n")
    res = runner.invoke(cli.app, ["config", "show", str(exp), "train.seq_len=64"])
    assert res.exit_code == 0, res.output
    rows = {ln.split()[0]: ln for ln in res.output.splitlines() if ln.strip()}
    assert "exp.yaml" in rows["train.steps"] and "11" in rows["train.steps"]
    assert "command line" in rows["train.seq_len"]
    assert "preset models/tiny-llama" in rows["model.hidden_size"]
    assert "preset recipes/tiny-demo" in rows["train.micro_batch_size"]
    assert "default" in rows["train.grad_clip"]


def test_config_validate_error_exit_code_and_key():
    res = runner.invoke(cli.app, ["config", "validate", "tiny-llama", "model.num_kv_heads=3"])
    assert res.exit_code == 2
    assert "model.num_kv_heads: 3 does not divide" in res.output


def test_config_show_yaml_roundtrip():
    import yaml

    res = runner.invoke(cli.app, ["config", "show", "tiny-llama", "--yaml", "--world-size", "4"])
    data = yaml.safe_load(res.output)
    assert data["parallel"]["dp_shard"] == 4 and data["train"]["global_batch_size"] == 8


def test_plugins_lists_core():
    res = runner.invoke(cli.app, ["plugins"])
    assert res.exit_code == 0 and "primus-core" in res.output and "attention:sdpa" in res.output


def test_help_does_not_import_torch():
    code = "import sys, primus.core.cli.app as c; print(json.dumps(['torch' in sys.modules, 'numpy' in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", "import json;" + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [False, False]
