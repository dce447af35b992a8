"""``primus profile`` (core's command) on the torchtitan backend: core's StepProfiler wraps torchtitan's
steps, the trace lands in <output_dir>/traces/rank0.json and the report counts GEMM time."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import TINY


def test_primus_profile_writes_traces_and_report(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PRIMUS_LAUNCHED")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "primus.core.cli.app",
            "profile",
            TINY,
            f"logging.output_dir={tmp_path}",
            "train.steps=2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "traces" / "rank0.json").is_file()
    report = (tmp_path / "profile" / "report.md").read_text()
    assert "| 0 |" in report, report
    table = [
        line.split("|")[1:-1] for line in report.split("## Kernel categories")[1].splitlines() if line.startswith("|")
    ]
    header, rank0 = [c.strip() for c in table[0]], [c.strip() for c in table[2]]
    gemm_share = float(rank0[header.index("gemm")].rstrip("%"))
    assert gemm_share > 10, report  # torchtitan's matmuls traced and counted as GEMM
    # steps raised to wait + warmup + active + 1 so the profiler's schedule completes
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
