"""``primus analyze --compare RUN_A RUN_B``: the stored H200 step against a copy of it whose GEMMs run 20% shorter
(every later kernel moved earlier by the time saved, as a faster GEMM would): the differences printed are the ones
made, worked out here from the events alone."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from primus.core.cli import app as cli
from primus.core.profile.analyze import DEVICE_CATS, categorize

TRACE = Path(__file__).parent / "data" / "h200_llama3.2-1b_torchtitan.trace.json.gz"
FASTER = 0.2  # GEMMs 20% shorter


def _faster_gemms(src: Path, dst: Path) -> dict[str, float]:
    """Writes the copy; returns the stored step's window, idle and GEMM time, and the time the copy saves."""
    data = json.loads(gzip.decompress(src.read_bytes()))
    dev = sorted((e for e in data["traceEvents"] if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    start, end = dev[0]["ts"], max(e["ts"] + e["dur"] for e in dev)
    saved, gemm = 0.0, 0.0
    for e in dev:  # one stream: each kernel moves earlier by what the GEMMs before it saved
        e["ts"] -= saved
        if categorize(e["name"]) == "gemm":
            gemm += e["dur"]
            saved += FASTER * e["dur"]
            e["dur"] *= 1 - FASTER
    for e in data["traceEvents"]:
        if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("ProfilerStep"):
            e["dur"] -= saved
    dst.write_bytes(gzip.compress(json.dumps(data).encode()))
    return {"window": end - start, "gemm": gemm, "saved": saved}


def _row(text: str, name: str, section: str) -> list[str]:
    """The cells of ``name``'s row in the markdown table under the heading starting with ``section``."""
    part = text.split(f"## {section}")[1].split("\n## ")[0]
    line = next(ln for ln in part.splitlines() if ln.startswith(f"| {name} |"))
    return [c.strip() for c in line.strip("|").split("|")][1:]


def _num(cell: str) -> float:
    return float(re.match(r"[-+]?\d+(\.\d+)?", cell).group(0))


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    made = _faster_gemms(TRACE, tmp / "faster.trace.json.gz")
    res = CliRunner().invoke(
        cli.app, ["analyze", "--compare", str(TRACE), str(tmp / "faster.trace.json.gz"), "--out", str(tmp / "out")]
    )
    assert res.exit_code == 0, res.output
    return made, res.output, (tmp / "out" / "compare.md").read_text(), (tmp / "out" / "compare.html").read_text()


def test_the_differences_printed_are_the_ones_made(compared):
    made, _, md, _ = compared
    w, g, saved = made["window"], made["gemm"], made["saved"]
    assert saved == pytest.approx(FASTER * g)
    # GEMM time per step: -20%; no other category's time moved
    assert _row(md, "GEMM", "Kernel time per step")[2] == "-20.0%"
    for cat in ("attention", "norm", "elementwise", "optimizer", "memory", "other"):
        assert _row(md, cat, "Kernel time per step")[2] == "+0.0%", cat
    # the step is shorter by the time saved: in %
    step = _row(md, "step time", "Step")
    assert _num(step[0]) == pytest.approx(w / 1e3, abs=0.006)
    assert _num(step[2]) == pytest.approx(-saved / w * 100, abs=0.051)
    # idle time is unchanged, so its share grows by idle/(w - saved) - idle/w; compute's falls by as much
    a_idle = _num(_row(md, "idle", "Where the time goes")[0]) / 100
    idle_us = a_idle * w
    expected_idle = (idle_us / (w - saved) - idle_us / w) * 100
    assert _num(_row(md, "idle", "Where the time goes")[2]) == pytest.approx(expected_idle, abs=0.06)
    assert _num(_row(md, "compute", "Where the time goes")[2]) == pytest.approx(-expected_idle, abs=0.06)
    assert _row(md, "exposed communication", "Where the time goes")[2] == "+0.0 pts"
    # GEMM's share of kernel time: 0.8g / (k - saved) against g / k
    k = _num(_row(md, "kernel time", "Step")[0]) * 1e3
    expected_gemm = (0.8 * g / (k - saved) - g / k) * 100
    assert _num(_row(md, "GEMM", "Kernel categories")[2]) == pytest.approx(expected_gemm, abs=0.06)
    # MFU: same FLOPs in less time
    mfu = _row(md, "MFU", "Step")
    assert _num(mfu[1]) / _num(mfu[0]) == pytest.approx(w / (w - saved), rel=2e-3)


def test_printed_and_written(compared):
    _, output, md, page = compared
    assert "-20.0%" in output and "Comparison" in output  # printed to the terminal
    assert md.startswith("# Comparison") and "HolisticTraceAnalysis" in md  # each side names its engine
    assert page.startswith("<!doctype html>") and page.count("<table>") == 4 and "-20.0%" in page


def test_compare_needs_two_runs_and_reads_folders(tmp_path):
    res = CliRunner().invoke(cli.app, ["analyze", "--compare", str(TRACE)])
    assert res.exit_code == 2 and "two runs" in res.output
    run = tmp_path / "run" / "traces"  # a run's output folder: its traces/ are read
    run.mkdir(parents=True)
    (run / "rank0.json.gz").write_bytes(TRACE.read_bytes())
    res = CliRunner().invoke(cli.app, ["analyze", "--compare", str(tmp_path / "run"), str(TRACE), "--engine", "primus"])
    assert res.exit_code == 0, res.output
    assert "+0.0%" in res.output and "primus's built-in trace parser" in res.output
