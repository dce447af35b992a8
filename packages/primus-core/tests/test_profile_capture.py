"""primus profile: a backend's steps traced through StepProfiler, then the report written from the traces."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from primus.core import hookimpl
from primus.core.cli import app as cli
from primus.core.contracts import plugins
from primus.core.contracts.engine import BackendSpec
from primus.core.contracts.plugins import Registry, build_plugin_manager
from primus.core.run import metrics
from primus.core.run.testing import StandInEngine

torch = pytest.importorskip("torch")


class MatmulEngine(StandInEngine):
    """Core's stand-in with real work in its step: four matmuls and SiLUs a step, for the profiler to trace."""

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.x = torch.randn(128, 128)

    def train_step(self, step, lr, gate):
        for _ in range(4):
            self.x = torch.nn.functional.silu(self.x @ self.x)
            self.x = self.x / self.x.norm()
        return super().train_step(step, lr, gate)


class Backend:
    @staticmethod
    @hookimpl
    def primus_backends():
        return [BackendSpec("matmul", "", engine=MatmulEngine)]


def test_profile_writes_traces_and_report(tmp_path, monkeypatch):
    monkeypatch.setenv(plugins.DISABLE_ENV, "1")
    monkeypatch.setattr(plugins, "_cached", Registry(build_plugin_manager(extra_plugins=[("matmul", Backend)])))
    # a CPU has no peak in core's table: give it one, so the loop's MFU reaches the report
    monkeypatch.setattr(metrics, "peak_flops", lambda name: 1e9)
    res = CliRunner().invoke(
        cli.app,
        [
            "profile",
            "tiny-llama",
            "backend.name=matmul",
            "train.steps=2",
            f"logging.output_dir={tmp_path}",
            "logging.tensorboard=false",
        ],
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "traces" / "rank0.json").is_file()

    meta = json.loads((tmp_path / "traces" / "rank0.json").read_text())["primus"]  # what analyze needs for MFU
    assert meta["model"] == "tiny-llama" and meta["active_steps"] >= 1 and meta["flops_per_token"] > 0
    assert meta["model_flops_per_step_per_device"] == pytest.approx(
        meta["tokens_per_step_per_device"] * meta["flops_per_token"]
    )
    assert {k: meta["layout"][k] for k in ("world", "tp", "pp", "cp")} == {"world": 1, "tp": 1, "pp": 1, "cp": 1}
    assert isinstance(meta["kernels"], dict)  # the providers the backend selected (none for this one)
    report = (tmp_path / "profile" / "report.md").read_text()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    mfu = f"MFU (last logged interval): {rows[-1]['mfu']:.1%}"
    assert rows[-1]["mfu"] > 0 and "| 0 |" in report and mfu in report
    # a CPU trace: primus's own parser, and the report says why
    assert "Engine: Time shares from primus's built-in trace parser: HolisticTraceAnalysis cannot read" in report
    page = (tmp_path / "profile" / "report.html").read_text()
    assert page.count("<table>") >= 4 and "CPU-only" in page and mfu in page
    assert "tiny-llama" in page and ">thread " in page  # the run summary; the timeline's lanes are CPU threads
    gemm_share = report.split("## Kernel categories")[1].splitlines()[4].split("|")[2].strip()
    assert float(gemm_share.rstrip("%")) > 0  # the matmuls were traced and counted as GEMM
    assert len(rows) == 5  # steps raised to wait + warmup + active + 1 so the schedule completes
