"""Profiling (issue #6): core's StepProfiler wraps the megatron training loop.

``primus profile`` traces a few steps and writes the step-time report; on 2 ranks with ``profile.ranks=[0,1]`` it
writes one trace per rank and reports both (one process: the same code, run by TorchTitan's and the CLI's tests).
"""

from __future__ import annotations

import json

import pytest
from megatron_helpers import TINY, primus, read_metrics

# the schedule wait 0 → warmup 1 → active 1: `primus profile` raises train.steps to 3
FEW_STEPS = ["train.steps=2", "profile.wait=0", "profile.warmup=1", "profile.active=1"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "run"
    proc = primus("profile", TINY, out, 2, *FEW_STEPS, "profile.ranks=[0,1]")
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


def _category_shares(report: str) -> dict[str, float]:
    section = report.split("## Kernel categories")[1].split("##")[0]
    table = [line for line in section.splitlines() if line.startswith("|")]  # header, ---, rank 0
    names = [c.strip() for c in table[0].strip("|").split("|")][1:]
    values = [float(c.strip().rstrip("%")) for c in table[2].strip("|").split("|")[1:]]
    shares = dict(zip(names, values, strict=True))
    shares.pop("kernel ms", None)  # the table's total, not a category
    return shares


def test_primus_profile_writes_trace_and_report(profiled):
    assert [r["step"] for r in read_metrics(profiled)] == [1, 2, 3]
    trace = json.loads((profiled / "traces" / "rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    # the traced step ran megatron's own modules: its tensor-parallel linears and the optimizer
    assert any(n.startswith("LinearWithGradAccumulationAndAsyncCommunication") for n in names)
    assert any("Optimizer.step" in n for n in names), sorted(names)[:50]
    report = (profiled / "profile" / "report.md").read_text()
    assert "on megatron" in report and "| 0 |" in report
    assert sum(_category_shares(report).values()) == pytest.approx(100, abs=0.5)
    assert (profiled / "profile" / "report.html").is_file()


def test_report_counts_gemm_time(profiled):
    assert _category_shares((profiled / "profile" / "report.md").read_text())["gemm"] > 0


def test_two_ranks_each_write_a_trace(profiled):
    report = (profiled / "profile" / "report.md").read_text()
    assert "| 0 |" in report and "| 1 |" in report
    for rank in (0, 1):
        trace = json.loads((profiled / "traces" / f"rank{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("LinearWithGradAccumulation") for n in names), rank
        assert any("gloo" in n or "all_reduce" in n.lower() for n in names), rank  # the DP gradient reduce
