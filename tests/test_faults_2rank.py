"""Faults of a real run (tiny-demo: TorchTitan, CPU, gloo) on 1 and 2 ranks through ``primus train``, each said in
one line with no Python or torchrun traceback on stderr:

- a rank SIGKILLed mid-save (test-only fault injection): ``rank 1 ... killed by SIGKILL ... (exit code 137)``;
- the resume (``checkpoint.resume=auto``) drops the metrics rows written after the checkpoint it resumes from, so
  metrics.jsonl holds each step once, with the values the straight run had;
- a checkpoint save on a full file system (a 28 MiB tmpfs: two checkpoints fit, a third does not):
  ``no space left on tmpfs (mounted at ...) for ...``, exit 1, the last checkpoint intact; with space again the same
  command resumes from it;
- SIGTERM before the first step (Slurm's preemption while the run starts): the run stops after its first step
  with a checkpoint and exits 75 (``primus.core.run.stop.PREEMPTED_EXIT``) on 1 and on 2 ranks;
- a data cache on a full file system: one line naming it.

Needs root for the tmpfs (skipped, saying so, where ``mount`` is refused)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hf_helpers import _env, _free_port

from primus.core.run.stop import PREEMPTED_EXIT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

COMMON = [
    "train.steps=6",
    "train.schedule.warmup_steps=0",
    "logging.interval=1",
    "logging.tensorboard=false",
    "checkpoint.interval=2",
    "checkpoint.resume=auto",
]


def _cmd(out: Path, *overrides: str, nproc: int = 2) -> list[str]:
    cmd = [sys.executable, "-m", "primus.core.cli.app", "train", "tiny-demo", f"logging.output_dir={out}", *COMMON]
    cmd += overrides
    return cmd + (["--nproc-per-node", str(nproc), "--master-port", str(_free_port())] if nproc > 1 else [])


def _train(out: Path, *overrides: str, nproc: int = 2, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        _cmd(out, *overrides, nproc=nproc), capture_output=True, text=True, timeout=300, env=env or _env()
    )


def _catching_sigterm(pid: int) -> int:
    """How many of ``pid``'s descendant rank processes (LOCAL_RANK in their environment) catch SIGTERM, from
    /proc/<pid>/status's SigCgt mask."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, ranks = list(children.get(pid, [])), 0
    while todo:
        child = todo.pop()
        todo += children.get(child, [])
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            status = Path(f"/proc/{child}/status").read_text()
        except OSError:
            continue
        if any(v.startswith(b"LOCAL_RANK=") for v in environ):
            mask = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
            ranks += bool(mask >> (signal.SIGTERM - 1) & 1)
    return ranks


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _one_error(proc: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line of a failed run; no traceback of Python or torchrun around it."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-6000:]
    for sign in ("Traceback", "ChildFailedError", "SignalException", "[rank0]:", "[rank1]:"):
        assert sign not in proc.stderr, proc.stderr[-6000:]
    return lines[0]


def _mount(where: Path, size: str, remount: bool = False) -> None:
    opts = f"{'remount,' if remount else ''}size={size}"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root): {proc.stderr.strip()}")


@pytest.fixture(scope="module")
def crashes(tmp_path_factory):
    """One folder on a 28 MiB tmpfs, three runs of the same 2-rank command: rank 1 killed writing the step-4
    checkpoint; the resume from step 2, whose step-6 save fills the disk; the resume from step 4 with space."""
    fs = tmp_path_factory.mktemp("faults") / "fs"
    fs.mkdir()
    _mount(fs, "28m")
    out = fs / "run"
    try:
        killed = _train(out, "backend.extra.fault_injection.kill_during_save_at_step=4")
        killed_rows = _rows(out)
        full = _train(out)
        full_rows, full_ckpts = _rows(out), sorted(p.name for p in (out / "checkpoints").iterdir())
        _mount(fs, "64m", remount=True)
        resumed = _train(out)
        yield {
            "out": out,
            "fs": fs,
            "killed": (killed, killed_rows),
            "full": (full, full_rows, full_ckpts),
            "resumed": (resumed, _rows(out)),
        }
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


def test_a_rank_killed_mid_save_is_one_line_naming_it(crashes):
    proc, rows = crashes["killed"]
    line = _one_error(proc)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-4000:]
    assert line.startswith("error: rank 1 (pid ") and line.endswith(
        "was killed by SIGKILL; the job stopped (exit code 137)"
    )
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_a_full_disk_at_a_save_is_one_line_and_keeps_the_last_checkpoint(crashes):
    proc, rows, ckpts = crashes["full"]
    out, fs = crashes["out"], crashes["fs"]
    line = _one_error(proc)
    assert line == (
        f"error: no space left on tmpfs (mounted at {fs}) for {out / 'checkpoints' / 'step_00000006.tmp'}; "
        f"{out / 'checkpoints' / 'step_00000004'} (step 4) is intact: free space and resume"
    )
    assert ckpts == ["step_00000002", "step_00000004"]  # the partial step-6 save is gone, the others kept
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]


def test_a_full_disk_at_a_save_exits_1(crashes):
    """Both ranks fail the save: each left with 0 (a backend's quiet exit at atexit overrode the code), and where only
    one did, the job took the code of the rank torchrun stopped (143): one run in four each."""
    assert crashes["full"][0].returncode == 1


def test_each_resume_keeps_each_step_once_with_the_straight_values(crashes):
    (_, killed), (_, full, _), (proc, rows) = crashes["killed"], crashes["full"], crashes["resumed"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # not 1-4, 3-6, 5, 6
    # steps 3-4 were trained twice (the killed run, the resume from 2), 5-6 twice: the same values each time
    assert [r["loss"] for r in full[2:4]] == pytest.approx([r["loss"] for r in killed[2:4]], rel=1e-6)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in full], rel=1e-6)
    assert json.loads((crashes["out"] / "summary.json").read_text())["start_step"] == 4


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_before_the_first_step_stops_after_it_with_exit_75(tmp_path, nproc):
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen(_cmd(out, nproc=nproc), stdout=subprocess.DEVNULL, stderr=err, env=_env())
    # every rank has started primus train (its stop handler is on: the kernel asks it to catch SIGTERM; ranks other
    # than 0 print nothing before training) and none has trained a step
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if "kernels:" in log.read_text() and _catching_sigterm(proc.pid) == (nproc if nproc > 1 else 0):
            break
        time.sleep(0.1)
    assert proc.poll() is None and not (out / "metrics.jsonl").exists(), log.read_text()[-4000:]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=240)
    text = log.read_text()
    assert proc.returncode == PREEMPTED_EXIT, text[-4000:]
    assert "SIGTERM received while the run starts" in text and "Traceback" not in text, text[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["final_step"] == 1 and summary["stop_reason"] == "SIGTERM"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]


def test_a_full_data_cache_is_one_line_naming_it(tmp_path):
    fs = tmp_path / "cache"
    fs.mkdir()
    _mount(fs, "64k")
    try:
        (fs / "filler").write_bytes(b"x" * (64 << 10))
        env = {**_env(), "PRIMUS_CACHE": str(fs / "primus")}
        proc = _train(tmp_path / "run", nproc=1, env=env)
        line = _one_error(proc)
        assert proc.returncode == 1
        assert line.startswith(f"error: no space left on tmpfs (mounted at {fs}) for {fs / 'primus'}"), line
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


@pytest.mark.parametrize("nproc", [1, 2])
def test_out_of_memory_is_one_line_with_its_own_exit_code_and_the_checkpoint_kept(tmp_path, nproc):
    """Torch's out-of-memory error at step 3 (test-only fault injection, on rank 1 of 2: rank 0 is left in the step's
    collectives): one line with the step, the memory, the planner's estimate and pick, the last checkpoint (step 2,
    committed, verifying); exit 3 (``primus.core.run.oom.OOM_EXIT``) on every rank count."""
    from primus.core.run.checkpoints import verify
    from primus.core.run.oom import OOM_EXIT

    out = tmp_path / "run"
    rank = nproc - 1
    proc = _train(out, "backend.extra.fault_injection.oom_at_step=3", f"backend.extra.fault_injection.oom_rank={rank}",
                  nproc=nproc)  # fmt: skip
    assert proc.returncode == OOM_EXIT, proc.stderr[-4000:]
    line = _one_error(proc)
    kept = out / "checkpoints" / "step_00000002"
    assert line.startswith(f"error: out of memory at step 3 on rank {rank}: "), line
    assert "GiB peak resident in this process; the memory model estimated " in line
    assert f"; the last checkpoint, {kept}, is intact (--resume continues from it); the planner's pick " in line
    # its words last; on one CPU rank the pick is the run's own layout, which it says
    assert re.search(r"\): add \S+=\S+$", line) or "the planner's pick is this run's own layout" in line, line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"] and verify(kept) == []
    assert [r["step"] for r in _rows(out)] == [1, 2]
