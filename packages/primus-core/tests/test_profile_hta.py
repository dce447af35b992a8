"""The report's time shares from HolisticTraceAnalysis (HTA), and the fallback to primus's own parser.

HTA is core's ``profile`` extra (nox installs core's extras for these tests); a missing HTA fails the tests that
need it, with the command that installs it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from primus.core.profile import hta_engine
from primus.core.profile.analyze import RankReport, analyze_run
from primus.core.profile.report import SHARES, html_page, markdown

TRACE = Path(__file__).parent / "data" / "h200_llama3.2-1b_torchtitan.trace.json.gz"
GEMM = "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN"
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _require_hta() -> None:
    assert hta_engine.version(), "HolisticTraceAnalysis is not installed: pip install 'primus-core[profile]'"


@pytest.fixture(scope="module")
def h200():
    _require_hta()
    return analyze_run([TRACE], engine="hta"), analyze_run([TRACE], engine="primus")


def test_hta_agrees_with_primus_on_the_h200_trace(h200):
    """Every share within 1 point (it is within 0.001 point: the same intervals, summed by two programs)."""
    hta, own = h200
    (h,), (p,) = hta.reports, own.reports
    assert hta.engine == "hta" and f"HolisticTraceAnalysis {hta_engine.version()};" in hta.engine_line
    assert own.engine == "primus"
    for key in SHARES:
        assert abs(h.shares()[key] - p.shares()[key]) < 0.01, (key, h.shares(), p.shares())
        assert h.shares()[key] == pytest.approx(p.shares()[key], abs=1e-5)
    assert h.window_us == pytest.approx(p.window_us, rel=1e-6) and h.step_us == pytest.approx(p.step_us, rel=1e-6)
    # in HTA's own terms: its compute leaves out the memcpy / memset kernels (0.18% here) that primus counts
    assert h.hta["compute"] + h.hta["non-compute"] == pytest.approx(p.shares()["compute"], abs=1e-5)
    assert 0.001 < h.hta["non-compute"] < 0.003 and h.hta["idle"] == pytest.approx(p.shares()["idle"], abs=1e-5)
    assert "comm-comp overlap" not in h.hta  # one GPU: no communication to overlap
    assert h.launch is None  # the stored trace was trimmed to the device timeline: no cudaLaunchKernel events
    # primus's own: the kernel categories, FP8 share and MFU are the same numbers under either engine
    assert h.categories == p.categories and h.mfu == pytest.approx(p.mfu, rel=1e-6)
    md = markdown(hta)
    assert "Engine: Time shares, communication overlap, kernel types and CUDA launches from Holistic" in md
    assert "## HolisticTraceAnalysis, in its own terms" in md and "not in the trace" in md


def test_why_hta_rounding_is_turned_off():
    """By default HTA rounds each event to whole microseconds (start up, end down, for pytorch#122425): on this step
    of 1,910 kernels that drops ~1.9 ms of 169 ms of kernel time (1.1 points of compute share), and its temporal
    breakdown then fails its own check (non-compute < 0). The trace's nanosecond timestamps are right; the engine
    reads them unrounded (HTA_DISABLE_NS_ROUNDING=1), which is what makes it agree with primus's parser."""
    _require_hta()
    import logging

    from hta.analyzers.breakdown_analysis import BreakdownAnalysis
    from hta.common.trace import Trace

    logging.getLogger("hta").setLevel(logging.ERROR)
    t = Trace(trace_files={0: str(TRACE.resolve())}, trace_dir=str(TRACE.parent.resolve()))
    t.load_traces(include_last_profiler_step=True, use_multiprocessing=False, use_memory_profiling=False)
    rounded = t.get_trace(0)
    rounded = float(rounded[rounded["stream"].ne(-1)]["dur"].sum())
    (p,) = analyze_run([TRACE], engine="primus").reports
    exact = sum(p.categories.values())
    assert (exact - rounded) / p.window_us > 0.01  # more than a point of the step lost to rounding
    with pytest.raises(AssertionError):
        BreakdownAnalysis.get_temporal_breakdown(t, visualize=False)


def _trace(path: Path, rank: int, kernels: list[tuple[str, float, float, int]]) -> Path:
    """A GPU trace: kernels (name, start, duration, stream), each launched by a 2 us cudaLaunchKernel 5 us before."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 200}]
    for i, (name, ts, dur, stream) in enumerate(kernels):
        corr = {"correlation": 100 + i, "External id": 100 + i}
        events.append(
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts - 5, "dur": 2}
            | {"args": corr}
        )
        events.append(
            {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur}
            | {"args": {"stream": stream, "device": 0, **corr}}
        )
    data = {"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": 2}, "traceEvents": events}
    with gzip.open(path, "wt") as fh:
        json.dump(data, fh)
    return path


def test_two_ranks_with_communication_and_launches(tmp_path):
    """Overlap and exposed communication through HTA on two ranks, the same as primus's; launch statistics."""
    _require_hta()
    paths = [
        # rank 0: gemm 10-50, all-reduce 40-70 (10 overlapped, 20 exposed), flash 80-100, idle 70-80
        _trace(tmp_path / "rank0.json.gz", 0, [(GEMM, 10, 40, 7), (ALLREDUCE, 40, 30, 9), ("flash_fwd", 80, 20, 7)]),
        # rank 1: gemm 10-70 hides the all-reduce 20-40; norm 75-100
        _trace(tmp_path / "rank1.json.gz", 1, [(GEMM, 10, 60, 7), (ALLREDUCE, 20, 20, 9), ("rms_norm", 75, 25, 7)]),
    ]
    hta, own = analyze_run(paths, engine="hta"), analyze_run(paths, engine="primus")
    assert hta.engine == "hta"
    for h, p in zip(hta.reports, own.reports, strict=True):
        for key in SHARES:
            assert h.shares()[key] == pytest.approx(p.shares()[key], abs=1e-3), (h.rank, key)
    r0, r1 = hta.reports
    assert r0.shares()["exposed communication"] == pytest.approx(20 / 90, abs=1e-3)
    assert r0.hta["comm-comp overlap"] == pytest.approx(1 / 3, abs=1e-3) and r1.hta["comm-comp overlap"] == 1.0
    assert r0.launch["launches"] == 3 and r0.launch["launch_delay_median_us"] == pytest.approx(3.0)
    assert "| 0 | 66.7% | 22.2% | 11.1% | 33.3% | 3 | 3.0 / 3.0 | 0.0% |" in markdown(hta)
    assert "COMPUTATION overlapping COMMUNICATION" in hta.kernel_types


def test_without_hta_the_report_says_so(monkeypatch):
    monkeypatch.setattr(hta_engine, "version", lambda: None)
    run = analyze_run([TRACE])
    assert run.engine == "primus"
    assert run.engine_line == (
        "Time shares from primus's built-in trace parser: HolisticTraceAnalysis is not installed "
        "(pip install 'primus-core[profile]')."
    )
    assert f"Engine: {run.engine_line}" in markdown(run) and "HolisticTraceAnalysis, in its own" not in markdown(run)
    with pytest.raises(hta_engine.Unavailable, match="not installed"):
        analyze_run([TRACE], engine="hta")


def test_a_cpu_trace_falls_back_to_primus(tmp_path):
    """A CPU-only trace (the tiny CPU demo's): no GPU kernels for HTA, primus's parser answers, and says why."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(128, 128)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            a = torch.nn.functional.silu(a @ a)
            a = a / a.norm()
    path = tmp_path / "rank0.json"
    prof.export_chrome_trace(str(path))
    run = analyze_run([path])
    assert run.engine == "primus" and "no GPU kernels (CPU-only)" in run.engine_line
    (r,) = run.reports
    assert isinstance(r, RankReport) and r.timeline and r.timeline[-1][0].startswith("thread")
    page = html_page(run)
    assert "<table>" in page and "CPU-only" in page and "thread " in page
