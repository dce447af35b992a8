"""A truncated ``.distcp`` shard in the newest checkpoint, on both engines (one process each): ``primus checkpoint
verify`` and ``export`` refuse it naming the file (exit 2, one ``error:`` line for export, no traceback), and
``primus train --resume`` resumes from the step before with a warning naming the file, and trains on as the first run
did. (Core's own tests, packages/primus-core/tests/test_checkpoint_integrity.py, cover the rest with a fake engine.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hf_helpers import _env, run_config, train

from primus.core.run.checkpoints import verify as verify_files

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _primus(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "primus.core.cli.app", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**_env(), "COLUMNS": "1000"})


def _flat(text: str) -> str:  # a logged path may still be wrapped over lines
    return "".join(text.split())


@pytest.mark.parametrize("backend", ["megatron", "torchtitan"])
def test_a_truncated_shard_is_named_and_resume_takes_the_step_before(tmp_path, backend):
    config = run_config(tmp_path / "run.yaml", backend, train={"steps": 3}, checkpoint={"interval": 1, "keep_last": 3})
    out = tmp_path / "run"
    first = train(config, out)
    newest = out / "checkpoints" / "step_00000003"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    problem = f"{shard}: {size // 2} bytes, the manifest records {size}"

    verify = _primus("checkpoint", "verify", str(out / "checkpoints"))
    assert verify.returncode == 2, verify.stdout + verify.stderr
    assert f"BROKEN {newest} (step 3):" in verify.stdout and problem in verify.stdout
    assert verify.stdout.count("OK ") == 2  # steps 1 and 2

    export = _primus("checkpoint", "export", str(newest), "--to-hf", str(tmp_path / "hf"))
    assert export.returncode == 2 and "Traceback" not in export.stderr
    assert export.stderr.strip() == f"error: checkpoint {newest} is broken: {problem}"
    assert not (tmp_path / "hf").exists()

    resumed = _primus("train", str(config), f"logging.output_dir={out}", "train.steps=4", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _flat(f"checkpoint {newest} (step 3) is broken, taking an older one: {problem}") in _flat(resumed.stderr)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["start_step"] == 2 and summary["final_step"] == 4 and summary["status"] == "ok"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the resumed run replaced the first run's step 3: each step once
    assert rows[2]["loss"] == pytest.approx(first[2]["loss"], rel=1e-6)  # step 3 again, from step 2's state
    assert verify_files(newest) == []  # written again, whole
