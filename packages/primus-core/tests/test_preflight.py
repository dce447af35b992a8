"""preflight on CPU: checks run and judge; collectives are verified across two real ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from primus.core.cli import app as cli
from primus.core.launch import preflight

pytest.importorskip("torch")
SMALL = ["--gemm-size", "128", "--copy-mib", "4", "--comm-mib", "1", "--iters", "2"]


def test_single_rank_passes_on_cpu():
    res = CliRunner().invoke(cli.app, ["preflight", *SMALL])
    assert res.exit_code == 0, res.output
    assert "GEMM 128³" in res.output and "copy 4 MiB" in res.output and "preflight: PASS" in res.output


def test_a_slow_device_fails(monkeypatch):
    monkeypatch.setattr(preflight, "peak_flops", lambda name: 1e18)  # pretend the CPU is a very fast GPU
    res = CliRunner().invoke(cli.app, ["preflight", *SMALL])
    assert res.exit_code == 1 and "FAIL" in res.output and "preflight: FAIL" in res.output


def test_two_ranks_check_collectives():
    out = subprocess.run(
        [sys.executable, "-m", "primus.core.cli.app", "preflight", "--nproc-per-node", "2", *SMALL],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [ln for ln in out.stdout.splitlines() if "all-reduce 1 MiB × 2" in ln or "all-gather 1 MiB × 2" in ln]
    assert len(rows) == 4 and all("PASS" in r for r in rows)  # both ranks, both collectives, right values
