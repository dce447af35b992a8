"""What primus-tune changes, as `primus config show` and `primus presets` report it."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from primus.core.cli import app as cli

runner = CliRunner()


def _rows(output: str) -> dict[str, str]:
    return {line.split()[0]: line for line in output.splitlines() if line.strip()}


def test_config_show_attributes_the_results_file_to_primus_tune(registry, cache_home, tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text("extends: [tiny-demo]\nkernels: {gemm_tuning: offline}\n")

    res = runner.invoke(cli.app, ["config", "show", str(exp)])

    assert res.exit_code == 0, res.output
    assert "plugin primus-tune" in _rows(res.output)["kernels.gemm_tuning_file"]
    assert "exp.yaml" in _rows(res.output)["kernels.gemm_tuning"]
    resolved = yaml.safe_load(runner.invoke(cli.app, ["config", "show", str(exp), "--yaml"]).output)
    assert resolved["kernels"]["gemm_tuning_file"] == str(cache_home / "primus" / "gemm" / "tiny-llama-fp32.json")


def test_a_file_named_in_the_config_wins(registry, cache_home, tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text("extends: [tiny-demo]\nkernels: {gemm_tuning: offline, gemm_tuning_file: /data/gemm.csv}\n")

    res = runner.invoke(cli.app, ["config", "show", str(exp)])

    assert res.exit_code == 0, res.output
    row = _rows(res.output)["kernels.gemm_tuning_file"]
    assert "exp.yaml" in row and "primus-tune" not in row
    resolved = yaml.safe_load(runner.invoke(cli.app, ["config", "show", str(exp), "--yaml"]).output)
    assert resolved["kernels"]["gemm_tuning_file"] == "/data/gemm.csv"


def test_tuned_recipe_is_listed_and_resolves(registry):
    res = runner.invoke(cli.app, ["presets", "list"])
    assert res.exit_code == 0, res.output
    row = _rows(res.output)["llama3.2-1b-torchtitan-fsdp-h200-1x1"]
    assert "llama3.2-1b" in row and "torchtitan" in row and "primus-tune" in row

    res = runner.invoke(cli.app, ["config", "show", "llama3.2-1b-torchtitan-fsdp-h200-1x1", "--world-size", "8"])
    assert res.exit_code == 0, res.output
    rows = _rows(res.output)
    assert (
        "preset recipes/llama3.2-1b-torchtitan-fsdp-h200-1x1" in rows["train.seq_len"]
        and "8192" in rows["train.seq_len"]
    )
    assert "preset models/llama3.2-1b" in rows["model.hidden_size"] and "2048" in rows["model.hidden_size"]
    assert "8" in rows["parallel.dp_shard"]


def test_offline_asked_for_on_the_command_line_gets_the_file_too(registry, cache_home):
    res = runner.invoke(cli.app, ["config", "show", "tiny-demo", "kernels.gemm_tuning=offline", "--yaml"])

    assert res.exit_code == 0, res.output
    assert yaml.safe_load(res.output)["kernels"]["gemm_tuning_file"].endswith("/primus/gemm/tiny-llama-fp32.json")


def test_train_refuses_gemm_tuning_on_a_cpu_before_writing_anything(registry, cache_home, tmp_path):
    out = tmp_path / "run"
    args = ["train", "tiny-demo", "kernels.gemm_tuning=offline", f"logging.output_dir={out}"]
    res = runner.invoke(cli.app, args)

    assert res.exit_code == 2, res.output
    assert "kernels.gemm_tuning: GEMM tuning needs a GPU" in res.output and "allowed: off on a CPU" in res.output
    assert not out.exists()
