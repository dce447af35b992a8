"""SIGTERM to a 2-rank run (what Slurm sends before a preemption), on both engines: every rank finishes its step,
one checkpoint is committed, ``primus train`` exits with the documented code (primus.core.run.stop.PREEMPTED_EXIT),
and the same command again (``checkpoint.resume: auto``, which also started the first run on an empty folder)
continues it: its losses equal those of an uninterrupted run at the same steps."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from hf_helpers import _env, _free_port, run_config, train

from primus.core.run.stop import PREEMPTED_EXIT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _rows(out):
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("backend", ["megatron", "torchtitan"])
def test_sigterm_mid_run_saves_once_and_the_same_command_continues(tmp_path, backend):
    config = run_config(
        tmp_path / "run.yaml", backend, train={"steps": 500}, checkpoint={"resume": "auto", "keep_last": 3}
    )
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "primus.core.cli.app", "train", str(config), f"logging.output_dir={out}"]
    cmd += ["--nproc-per-node", "2", "--master-port", str(_free_port())]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while len(_rows(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.stdout.read()[-4000:]
    assert _rows(out)[0]["step"] == 1  # resume: auto on an empty folder started fresh
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=180)[0]
    assert proc.returncode == PREEMPTED_EXIT, log[-4000:]
    assert "Traceback" not in log and "SignalException" not in log, log[-4000:]  # torchrun's, the workers'

    stopped = _rows(out)[-1]["step"]
    assert 2 <= stopped < 500
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["final_step"] == stopped
    folders = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert folders == [f"step_{stopped:08d}"]  # one checkpoint, complete (no .tmp left)
    assert (out / "checkpoints" / folders[0] / "manifest.json").exists()

    end = stopped + 2  # the requeued job: the same command (fewer steps, so the test is short; constant LR)
    resumed = train(config, out, f"train.steps={end}", nproc=2)
    straight = train(config, tmp_path / "straight", f"train.steps={end}", nproc=2)
    after = [r for r in resumed if r["step"] > stopped]
    assert [r["step"] for r in after] == [stopped + 1, end]
    assert [r["loss"] for r in after] == pytest.approx([r["loss"] for r in straight[stopped:]], rel=1e-6)
    assert [r["loss"] for r in resumed[:stopped]] == pytest.approx([r["loss"] for r in straight[:stopped]], rel=1e-6)
