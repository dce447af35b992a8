"""The GPU acceptance suite (benchmarks/gpu_suite.py): its whole code on CPU with the tiny presets (--smoke), so it
cannot rot between GPU leases; its speed rule; and the README's GPU table against the suite's committed result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402
import render_readme  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--out", str(out), "--smoke"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    return proc, json.loads((out / "gpu_suite.json").read_text()), (out / "gpu_suite.md").read_text()


def test_smoke_runs_every_part_and_every_row_passes(smoke):
    proc, result, table = smoke
    failed = [(r["row"], r.get("reason")) for r in result["rows"] if r["status"] != "passed"]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:])
    assert list(result["parts"]) == list(gpu_suite.PARTS)
    rows = {r["row"] for r in result["rows"]}
    for part in gpu_suite.PARTS:
        assert any(r.startswith(part) for r in rows), part
    # the runs really trained: loss curves, and the pairs' agreement where the suite checks it
    fp8 = next(r for r in result["rows"] if r["row"] == "fp8_dense/torchtitan/fp8_rowwise")
    assert len(fp8["losses"]) == 3 and fp8["loss_agreement"] < gpu_suite.TOLERANCE
    resumed = next(r for r in result["rows"] if r["row"] == "eval_resume/sigterm_resume")
    assert resumed["steps"] == list(range(1, gpu_suite.RESUME_END + 1)) and resumed["eval_loss"]
    assert 3 <= resumed["stopped_at"] < gpu_suite.RESUME_END - 1
    assert f"{len(result['rows'])} passed, 0 failed, 0 not run" in table
    # one engine a part trains where the other's row is the same code (its command validated instead)
    validated = {r["row"] for r in result["rows"] if r.get("note") == "validated, not trained (smoke)"}
    assert validated == {
        "fp8_dense/megatron/bf16",
        "fp8_dense/megatron/fp8_rowwise",
        "deepseek/torchtitan",
        "sft_hf/megatron",
        "sft_packing/padded",
        "lora/torchtitan/full",
        "lora/torchtitan/lora",
    }
    assert next(r for r in result["rows"] if r["row"] == "deepseek/megatron_mtp")["mtp_losses"]


def test_a_speed_feature_slower_than_its_baseline_fails_its_row():
    base = {"row": "plain", "tokens_per_s": 100.0}
    slow = gpu_suite.speed_pair({"row": "turbo", "status": "passed", "tokens_per_s": 90.0}, base, 1.0, "turbo slower")
    assert slow["status"] == "failed" and slow["reason"] == "turbo slower: 0.90x plain (needs >= 1.0)"
    fast = gpu_suite.speed_pair({"row": "turbo", "status": "passed", "tokens_per_s": 120.0}, base, 1.0, "x")
    assert fast["status"] == "passed" and fast["ratio"] == pytest.approx(1.2)


def test_readme_gpu_table_is_the_committed_result():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render_readme.py"), "--check"], text=True)
    assert proc.returncode == 0
    assert "Not measured" in render_readme.render(None)
    row = {"row": "dense/1b-4096/tt_turbo", "status": "passed", "tokens_per_s": 59129.0, "mfu": 0.54, "ratio": 1.14}
    result = {"date": "d", "gpu": "NVIDIA H100", "torch": "2.11", "command": "c", "rows": [{**row, "vs": "tt_plain"}]}
    assert "| dense/1b-4096/tt_turbo | passed | 59,129 |  | 54.0% | 1.14x | tt_plain |" in render_readme.render(result)
    # the committed result's rows the planner is held to carry its tokens/s and error
    assert "| dense/1b-4096/mg_turbo | passed | 61,984 | 61,566 (-0.7%) |" in (ROOT / "README.md").read_text()
