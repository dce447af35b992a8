"""Faults around a run's folder, with core's stand-in engine (primus.core.run.testing; tests/test_faults_2rank.py runs
the real engines under torchrun): one run per output folder (a lock naming its holder, released when the holder
dies), metrics.jsonl holding each step once after a resume, its folder removed mid-run, a full file system said in
one line with the last checkpoint kept."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from primus.core import hookimpl
from primus.core.launch.rank import run_rank
from primus.core.launch.resolve import resolve
from primus.core.run import disk, rundir
from primus.core.run.testing import StandInEngine, registry

pytest.importorskip("torch")  # run_rank detects the device through torch

BASE = ["backend.name=stand-in", "logging.tensorboard=false", "logging.interval=1", "train.steps=8"]


def _run(out: Path, *overrides: str, plugins=(), resume: bool = False) -> dict:
    StandInEngine.calls = []
    reg = registry(*plugins)
    return run_rank(resolve("tiny-llama", [*BASE, f"logging.output_dir={out}", *overrides], 1, reg), resume=resume)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# -- one run per output folder -----------------------------------------------------------------------------------

HOLDER = """
import sys, time
from pathlib import Path
from primus.core.run.rundir import hold
hold(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path / 'run'``'s lock, as a running ``primus train`` does."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield out, proc
    proc.kill()
    proc.wait()


def test_a_second_run_on_a_held_folder_is_refused_naming_the_holder_until_it_dies(holder, cli_registry):
    out, proc = holder
    from primus.core.cli import app as cli

    res = CliRunner().invoke(cli.app, ["train", "tiny-llama", "backend.name=fake", f"logging.output_dir={out}"])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert f"logging.output_dir {out} is in use by another run (pid {proc.pid} on " in lines[0]
    assert "started 20" in lines[0] and "Traceback" not in res.output
    assert sorted(p.name for p in out.iterdir()) == [rundir.LOCK_NAME]  # the refused run wrote nothing

    with pytest.raises(rundir.FolderInUse, match=f"pid {proc.pid} "):  # --resume too, in the run itself
        _run(out, resume=True)
    proc.send_signal(signal.SIGKILL)  # the OS releases a dead holder's lock: no stale lock
    proc.wait()
    assert _run(out)["status"] == "ok" and [r["step"] for r in _rows(out)] == list(range(1, 9))
    assert f"pid {os.getpid()} on " in (out / rundir.LOCK_NAME).read_text()  # the new holder's name
    rundir.hold(out)  # released at the run's end: this process can take it again
    rundir.release(out)


# -- metrics.jsonl across a resume and a removed folder ---------------------------------------------------------


def test_resume_drops_the_rows_written_after_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="engine failed at step 7"):  # the run dies after step 6's row
        _run(out, "checkpoint.interval=4", "backend.extra.fail_at=7")
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4, 5, 6]
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "lo')  # a row cut by a kill
    summary = _run(out, "checkpoint.resume=auto", "checkpoint.interval=4")
    assert summary["start_step"] == 4
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, 9))  # each step once (not 1..6, 5, 6, 7, 8)
    assert [r["loss"] for r in rows] == pytest.approx([10 / s for s in range(1, 9)])  # the straight run's values


class _RemoveOutputAt3:
    def __init__(self, out: Path) -> None:
        self.out = out

    @hookimpl
    def primus_on_optimizer_step(self, step, info):
        if step == 3:
            shutil.rmtree(self.out)


def test_an_output_folder_removed_mid_run_is_written_again_with_a_warning(tmp_path, caplog):
    """Chosen: recreate and warn, not fail. The run's checkpoints are written again anyway (atomic_save makes their
    folder); failing would throw away a run that can go on, over a folder that is easy to remove by mistake."""
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="primus.run"):
        summary = _run(out, "checkpoint.interval=4", plugins=[("remove", _RemoveOutputAt3(out))])
    assert summary["status"] == "ok"
    assert [r["step"] for r in _rows(out)] == [3, 4, 5, 6, 7, 8]  # rows 1-2 went with the folder
    assert f"{out / 'metrics.jsonl'} was removed during the run: writing it again from step 3" in caplog.text
    assert (out / "config.yaml").exists() and json.loads((out / "summary.json").read_text())["final_step"] == 8
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]
    rundir.hold(out)  # the run took the lock again on the new folder, and released it
    rundir.release(out)


# -- a full file system -----------------------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a small tmpfs (``mount -t tmpfs``; needs root): yields a function that mounts it with a size."""
    where = tmp_path / "fs"
    where.mkdir()
    mounted = []

    def mount(size: str, remount: bool = False) -> Path:
        opts = f"{'remount,' if remount else ''}size={size}"
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs to fill up (needs root): {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    if mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_checkpoint_on_a_full_disk_fails_in_one_line_and_the_last_one_resumes(tmpfs):
    fs = tmpfs("400k")  # 100 pages: one stand-in checkpoint (50) and the run's files fit, two do not
    out = fs / "run"
    with pytest.raises(disk.NoSpaceLeft) as info:
        _run(out, "checkpoint.interval=2")
    message = str(info.value)
    assert message == (
        f"no space left on tmpfs (mounted at {fs}) for {out / 'checkpoints' / 'step_00000004.tmp'}; "
        f"{out / 'checkpoints' / 'step_00000002'} (step 2) is intact: free space and resume"
    )
    assert "\n" not in message and info.value.exit_code == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]  # partial save removed
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"

    tmpfs("2m", remount=True)  # space freed: the same command continues from step 2
    summary = _run(out, "checkpoint.interval=2", "checkpoint.resume=auto")
    assert summary["status"] == "ok" and summary["start_step"] == 2 and StandInEngine.calls[0] == ("load", 2)
    assert [r["step"] for r in _rows(out)] == list(range(1, 9))


def test_a_full_output_folder_names_the_metrics_file(tmpfs):
    fs = tmpfs("64k")
    out = fs / "run"
    out.mkdir()
    (fs / "filler").write_bytes(b"x" * (52 << 10))  # 3 pages left: the lock, config.yaml, a page of metrics
    with pytest.raises(disk.NoSpaceLeft, match=f"^no space left on tmpfs \\(mounted at {fs}\\) for {out}/"):
        _run(out, "checkpoint.enabled=false", "train.steps=400")


def test_no_space_names_the_path_or_the_full_folder(tmp_path):
    import errno

    err = OSError(errno.ENOSPC, "No space left on device")
    assert str(disk.no_space(err, [tmp_path])).startswith("no space left on ")
    assert disk.no_space(err, [tmp_path]).path == tmp_path  # the error names no file: the candidate
    named = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.npy"))
    assert disk.no_space(named, [tmp_path]).path == tmp_path / "x.npy"
    assert disk.no_space(RuntimeError("boom"), [tmp_path]) is None  # plenty of space: not a full disk
    assert disk.no_space(OSError(errno.EACCES, "denied"), [tmp_path]) is None


def test_the_torchrun_wrapper_names_the_root_cause():
    """torchrun's own choice of the first failure ties at whole seconds: a rank killed by SIGKILL and the rank that
    then lost its connection (exit 1), or was stopped by torchrun's SIGTERM, at the same second."""
    from types import SimpleNamespace as F

    from primus.core.launch.torchrun import root_cause

    failures = {0: F(exitcode=1, timestamp=100), 1: F(exitcode=-9, timestamp=100), 2: F(exitcode=-15, timestamp=100)}
    assert root_cause(failures)[0] == 1
    assert root_cause({0: F(exitcode=1, timestamp=100), 1: F(exitcode=-9, timestamp=700)})[0] == 0  # much later
    assert root_cause({0: F(exitcode=1, timestamp=5), 1: F(exitcode=2, timestamp=5)})[0] == 1  # a refusal
    # a rank that failed on a full disk (exit 1) while torchrun stopped rank 0: the job's code is 1, not 143
    assert root_cause({0: F(exitcode=-15, timestamp=5), 1: F(exitcode=1, timestamp=5)})[0] == 1


def test_a_stop_signal_before_the_loop_stops_after_the_first_step(tmp_path):
    from primus.core.run import stop

    code = textwrap.dedent(
        """
        import os, signal
        from primus.core.run import stop
        with stop.listen_early():
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.pending() == "SIGTERM"
            with stop.StopRequest(None, 1) as request:
                assert request.agreed() == "SIGTERM" and stop.pending() is None
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handlers before it are back
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert stop.PREEMPTED_EXIT == 75


def test_the_launcher_shows_lines_as_they_come_but_no_worker_traceback():
    """Fed a byte at a time (as a pipe may give it): a worker's uncaught exception (``[rankN]: ...``) is kept per
    rank, torchrun's report is read, an error line said by two ranks is shown once, anything else passes whole."""
    import io

    from primus.core.launch.launcher import StderrFilter
    from primus.core.launch.torchrun import MARK

    shown = io.BytesIO()
    filt = StderrFilter(shown)
    report = b'{"rank": 1, "pid": 3, "exitcode": -9, "signal": "SIGKILL"}'
    data = (
        b"INFO hello\n[rank0]: Traceback (most recent call last):\n[rank0]:   File x\n"
        b"\x1b[31merror: no space\x1b[0m\nerror: no space\n\r progress bar\n"
        + MARK.encode()
        + report
        + b"\n[rank1] a log line\n[ra"
    )
    for i in range(len(data)):
        filt.feed(data[i : i + 1])
    filt.flush()
    assert shown.getvalue() == b"INFO hello\n\x1b[31merror: no space\x1b[0m\n\r progress bar\n[rank1] a log line\n[ra\n"
    assert filt.report == json.loads(report) and filt.errors == [b"error: no space"]
    assert filt.tracebacks == {0: [b"[rank0]: Traceback (most recent call last):\n", b"[rank0]:   File x\n"]}
