"""``primus tune gemm ...`` and ``primus benchmark ...`` through core's CLI, as the primus_commands hook mounts them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from primus.core.cli import app as cli
from primus.tune.results import Environment, GemmResults, TuningEntry
from primus.tune.shapes import linear_gemms

runner = CliRunner()


@pytest.fixture
def app(registry):
    if not any(g.name == "tune" for g in cli.app.registered_groups):
        cli.add_plugin_commands()
    return cli.app


def test_record_writes_the_shapes_of_a_real_step(app, tmp_path):
    out = tmp_path / "tiny.shapes.json"
    res = runner.invoke(
        app, ["tune", "gemm", "record", "tiny-llama", "train.seq_len=32", "--device", "cpu", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["source"]["tokens"] == 64 and data["source"]["device"] == "cpu"
    keys = {g["op"] + " " + g["layout"] + f" {g['m']}x{g['n']}x{g['k']}": g["count"] for g in data["gemms"]}
    # the output head (128 -> vocab 2048): forward, input gradient, weight gradient
    assert keys["mm NT 64x2048x128"] == 1 and keys["mm NN 64x128x2048"] == 1 and keys["mm TN 2048x128x64"] == 1
    assert keys["mm NT 64x352x128"] == 4  # gate and up, 2 layers
    assert len(data["gemms"]) == 15 and sum(g["count"] for g in data["gemms"]) == 45

    shown = runner.invoke(app, ["tune", "gemm", "show", str(out)])
    assert shown.exit_code == 0 and "2048" in shown.output and "backward" in shown.output


def test_record_defaults_beside_the_results_file(app, cache_home):
    res = runner.invoke(app, ["tune", "gemm", "record", "tiny-llama", "train.seq_len=16"])
    assert res.exit_code == 0, res.output
    data = json.loads((cache_home / "primus" / "gemm" / "tiny-llama-bf16.shapes.json").read_text())
    assert data["source"]["device"] == "meta"  # auto without a GPU: shapes without compute


def test_show_lists_shapes_gain_and_winner(app, tmp_path):
    fwd, dgrad, _ = linear_gemms(8192, 2048, 8192)
    res = GemmResults(Environment("NVIDIA H200", "cuda", "12.8", "cublasLt 120804", "2.11.0"), searcher="cublaslt")
    res.add(
        TuningEntry(
            fwd, 687.0, 716.0, {"algorithm": "AA==", "algorithm_id": 21, "heuristic_index": 2}, "tuned", "cublaslt"
        )
    )
    res.add(
        TuningEntry(
            dgrad, 719.0, 623.0, {"algorithm": "AA==", "algorithm_id": 6, "heuristic_index": 0}, "default", "cublaslt"
        )
    )
    path = res.save(tmp_path / "r.json")
    out = runner.invoke(app, ["tune", "gemm", "show", str(path)])
    assert out.exit_code == 0, out.output
    assert "NVIDIA H200" in out.output and "+4.2%" in out.output and "-13.4%" in out.output
    assert "cuBLASLt algo 21 (#2)" in out.output and "tuned algorithm kept for 1" in out.output
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert runner.invoke(app, ["tune", "gemm", "show", str(bad)]).exit_code == 2


def test_run_on_cpu_says_it_needs_a_gpu(app, tmp_path):
    out = tmp_path / "s.json"
    runner.invoke(
        app, ["tune", "gemm", "record", "tiny-llama", "train.seq_len=16", "--device", "meta", "--out", str(out)]
    )
    res = runner.invoke(app, ["tune", "gemm", "run", str(out)])
    assert res.exit_code == 2 and "needs a GPU" in res.output


def test_benchmark_gemm_on_cpu_measures_the_default(app, tmp_path):
    out = tmp_path / "b.json"
    res = runner.invoke(
        app, ["benchmark", "gemm", "--shape", "64,48,32,NT", "--dtype", "fp32", "--repeats", "2", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "no tuning here" in res.output
    (entry,) = json.loads(out.read_text())["entries"]
    assert entry["shape"]["layout"] == "NT" and entry["default_tflops"] > 0 and entry["winner"] == "default"
    assert runner.invoke(app, ["benchmark", "gemm", "--shape", "64,48"]).exit_code == 2


def test_benchmark_attention_times_each_available_provider(app, tmp_path):
    out = tmp_path / "a.json"
    args = ["benchmark", "attention", "--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    res = runner.invoke(app, [*args, "--dtype", "fp32", "--repeats", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = {r["provider"]: r for r in json.loads(out.read_text())}
    assert rows["sdpa"]["fwd_tflops"] > 0 and rows["sdpa"]["fwd_bwd_tflops"] > 0


def test_help_does_not_import_torch():
    code = (
        "import sys\nfrom primus.core.cli import app as cli\nsys.argv = ['primus', '--help']\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\nprint('TORCH', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "tune" in out and "benchmark" in out
    assert out.strip().endswith("TORCH False")
