"""``primus analyze`` on a stored trace of one real H200 training step (TorchTitan, Llama 3.2 1B preset, seq 4096,
micro-batch 2, bf16), recorded by ``benchmarks/memory_validation.py --trace-out`` and trimmed to the device
timeline. Format the file must have: gzipped Chrome trace JSON with ``traceEvents`` holding the kernels
(``cat: kernel``, ``gpu_memcpy``, ``gpu_memset``) and the ``ProfilerStep#N`` annotation of the one traced
step, and a top-level ``primus`` block (``model_flops_per_step_per_device``, ``peak_flops``, ``device_name``)
written by core's StepProfiler. The file is committed with the test; a missing file fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from primus.core.cli import app as cli
from primus.core.profile.analyze import _device_events, analyze_files, read_trace

TRACE = Path(__file__).parent / "data" / "h200_llama3.2-1b_torchtitan.trace.json.gz"


@pytest.fixture(scope="module")
def trace():
    assert TRACE.is_file(), f"the stored H200 trace is missing: {TRACE} (benchmarks/memory_validation.py --trace-out)"
    events, meta = read_trace(TRACE)
    (report,) = analyze_files([TRACE])
    return events, meta, report


def test_trace_is_a_real_h200_step(trace):
    events, meta, report = trace
    assert "H200" in meta["device_name"] and meta["peak_flops"] == 989e12
    assert meta["model"] == "llama3.2-1b" and meta["backend"] == "torchtitan"
    assert report.steps == 1 and report.kernels > 500  # one forward + backward + optimizer step of 16 layers
    assert TRACE.stat().st_size < 3 * 2**20


def test_shares_add_up_to_the_step_and_nothing_counts_twice(trace):
    events, _, r = trace
    assert r.compute_us + r.exposed_comm_us + r.overlapped_comm_us + r.idle_us == pytest.approx(r.window_us)
    assert min(r.compute_us, r.exposed_comm_us, r.overlapped_comm_us, r.idle_us) >= 0
    assert sum(r.shares().values()) == pytest.approx(1.0)
    assert r.step_us == pytest.approx(r.window_us)  # one traced step
    # each kernel lands in exactly one category: the categories sum to the kernels' summed time
    dev = _device_events(events)
    assert sum(r.categories.values()) == pytest.approx(sum(e["dur"] for e in dev))
    assert r.exposed_comm_us == 0 and r.overlapped_comm_us == 0  # one GPU: no collectives
    # one stream mostly: busy time is at most the window, and the GPU is busy most of it
    assert r.compute_us <= r.window_us and r.shares()["compute"] > 0.7


def test_gemm_and_attention_dominate(trace):
    _, _, r = trace
    total = sum(r.categories.values())
    assert max(r.categories, key=r.categories.get) == "gemm"
    assert (r.categories["gemm"] + r.categories["attention"]) / total > 0.6
    assert r.categories["attention"] / total > 0.05
    assert r.categories.get("other", 0) / total < 0.15  # the categories know the kernels of a real step


def test_mfu_from_the_trace(trace):
    _, meta, r = trace
    assert r.mfu == pytest.approx(meta["model_flops_per_step_per_device"] / (r.step_us * 1e-6) / 989e12)
    assert 0.3 < r.mfu < 0.7  # benchmarks/results/h200_baseline.md: 43-50% for this model and batch


def test_analyze_cli_on_the_stored_trace(tmp_path):
    res = CliRunner().invoke(cli.app, ["analyze", str(TRACE), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| 0 |"))
    assert row.split("|")[2].strip() == "1" and row.rstrip(" |").endswith("%")  # steps, MFU
    assert "<svg" in (tmp_path / "report.html").read_text()
