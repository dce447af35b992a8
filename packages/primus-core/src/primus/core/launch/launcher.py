"""The launcher: ``primus train`` (and ``eval``, ``preflight``) re-run under ``torch.distributed.run`` (torchrun), one
process per device, with the workers' stderr cut to what a person reads and a failure said in one line.

Each worker runs :mod:`primus.core.launch.torchrun` (torchrun's own entry point, its failure report one line) and in it
the command again, with :data:`LAUNCHED_ENV` set: one rank's run (:func:`primus.core.launch.rank.run_rank`).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from primus.core.run.stop import TORCHRUN_SIGNALS

log = logging.getLogger("primus.train")

LAUNCHED_ENV = "PRIMUS_LAUNCHED"


def torchrun_command(
    argv: list[str],
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    rdzv: str | None = None,
) -> list[str]:
    # torchrun, its failure report made one line (primus.core.launch.torchrun; the same arguments as torch.distributed.run)
    cmd = [
        sys.executable,
        "-m",
        "primus.core.launch.torchrun",
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
    ]
    if rdzv:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}"]
    else:
        cmd += [f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}"]
    return [*cmd, "-m", "primus.core.cli.app", *argv]


#: torchrun forwards these to its workers (SIGUSR1: what Slurm sends before a time limit or preemption) and waits
#: this long for them to commit their checkpoint before it kills them (torchrun reads its options from PET_*).
TORCHRUN_ENV = {"PET_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS, "PET_SHUTDOWN_TIMEOUT": "600"}


_ANSI = re.compile(rb"\x1b\[[0-9;]*m")
_RANK_LINE = re.compile(rb"^\[rank(\d+)\]: ")  # torch prints a worker's uncaught exception with this prefix
_MAYBE_RANK_LINE = re.compile(rb"(\[(r(a(n(k(\d+(\](:)?)?)?)?)?)?)?)?")  # a start that may still become one


class StderrFilter:
    """Copies torchrun's stderr (its workers' too) to ``dst`` as it comes, a line at a time once its start says what
    it is (so a progress bar still draws): shown, but for a worker's uncaught exception (lines ``[rankN]: ...``,
    kept per rank: after a rank is killed the others die of the lost connection) and
    :data:`primus.core.launch.torchrun.MARK`'s report (kept in :attr:`report`). Keeps the ``error:`` lines the workers
    printed (a run that failed saying why, in one line)."""

    def __init__(self, dst: Any) -> None:
        from primus.core.launch.torchrun import MARK

        self.dst, self.mark = dst, MARK.encode()
        self.report: dict[str, Any] | None = None
        self.errors: list[bytes] = []
        self.tracebacks: dict[int, list[bytes]] = {}
        self._line, self._mode = b"", None  # mode None: undecided, else "pass", "drop" or "mark"

    def feed(self, chunk: bytes) -> None:
        while chunk:
            end = chunk.find(b"\n")
            part, chunk = (chunk, b"") if end < 0 else (chunk[: end + 1], chunk[end + 1 :])
            self._line += part
            if self._mode is None:
                self._decide(complete=end >= 0)
                if self._mode == "pass":
                    self.dst.write(self._line)
            elif self._mode == "pass":
                self.dst.write(part)
                self._line = self._line[:256]  # enough to tell an error: line; a progress bar may never end one
            if end >= 0:
                self._end_line()
        self.dst.flush()

    def _decide(self, complete: bool) -> None:
        body = _ANSI.sub(b"", self._line).rstrip(b"\n")
        if body.startswith(self.mark[:1]):
            self._mode = "mark"
        elif _RANK_LINE.match(body):
            self._mode = "drop"
        elif body.startswith(b"error:") or b"error:".startswith(body):  # held whole: each rank may say the same
            if complete:
                self._mode = "drop" if body in self.errors else "pass"
        elif complete or not _MAYBE_RANK_LINE.fullmatch(body):
            self._mode = "pass"

    def _end_line(self) -> None:
        body = _ANSI.sub(b"", self._line).rstrip(b"\n")
        if self._mode == "mark":
            import json

            self.report = json.loads(body[len(self.mark) :])
        elif self._mode == "drop" and (m := _RANK_LINE.match(body)):
            self.tracebacks.setdefault(int(m.group(1)), []).append(self._line)
        elif body.startswith(b"error:") and body not in self.errors:
            self.errors.append(body)
        self._line, self._mode = b"", None

    def flush(self) -> None:
        if self._line:
            self.feed(b"\n")


def launch_torchrun(argv: list[str], output: Path | None = None, keep_fd: int | None = None, **kw: Any) -> int:
    """Run torchrun in its own session and pass it the stop signals once (a signal to the whole process group
    would reach it twice). Returns its exit code: :data:`primus.core.run.stop.PREEMPTED_EXIT` when the workers stopped
    early with a checkpoint (``output``'s summary says so), or when a stop signal ended the job before its first
    step; 2 when a worker refused the run (a user's mistake: its one-line error shown); else the failed worker's,
    said in one line (its rank, pid, signal and the exit code; ``128 + N`` for signal ``N``) unless the worker said
    why itself. Neither torchrun's traceback nor a worker's reaches the user, but for a worker that failed first
    without a word (a bug: its traceback is shown). ``keep_fd``: a file descriptor torchrun inherits (the output
    folder's lock, held as long as the job lives)."""
    import json
    import signal
    import threading

    from primus.core.run.stop import PREEMPTED_EXIT, SIGNALS

    cmd = torchrun_command(argv, **kw)
    log.info("launching: %s", shlex.join(cmd))
    env = {**TORCHRUN_ENV, **os.environ, LAUNCHED_ENV: "1"}
    if kw.get("nproc_per_node", 1) > 1:  # torchrun's own default for several workers, without its 5-line banner
        env.setdefault("OMP_NUM_THREADS", "1")
    if sys.stderr.isatty():  # the workers write through a pipe: keep rich's terminal output (progress bar)
        env.update({"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"})
    started = time.time()
    received: list[int] = []
    procs: list[subprocess.Popen] = []

    def forward(num: int, _frame: Any) -> None:
        received.append(num)
        for proc in procs:
            proc.send_signal(num)

    forwarded = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    previous = {num: signal.signal(num, forward) for num in forwarded}
    try:
        proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, stderr=subprocess.PIPE, pass_fds=(keep_fd,) if keep_fd else ()
        )
        procs.append(proc)
        for num in received:  # arrived while torchrun started
            proc.send_signal(num)
        filt = StderrFilter(sys.stderr.buffer)

        def pump() -> None:
            while chunk := os.read(proc.stderr.fileno(), 1 << 16):
                filt.feed(chunk)
            filt.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        rc = proc.wait()
        reader.join()
    finally:
        for num, handler in previous.items():
            signal.signal(num, handler)
    status = None
    if output is not None:  # a worker may leave with 0 after its early stop (torchrun then returns 0)
        summary = output / "summary.json"
        try:  # this launch's summary, not an earlier run's in the same folder
            fresh = summary.stat().st_mtime >= started
            status = json.loads(summary.read_text()).get("status") if fresh else None
        except (OSError, ValueError):
            status = None
    if status == "preempted":
        return PREEMPTED_EXIT
    report = filt.report
    if not rc or report is None:
        return rc
    stop = next((signal.Signals(n).name for n in received if signal.Signals(n).name in SIGNALS), None)
    if report.get("launcher") or report.get("exitcode") == PREEMPTED_EXIT:
        if stop and status != "failed" and not filt.errors:  # stopped before the loop could save: nothing lost
            _say(f"stopped by {stop} before the first step: nothing to save; the same command starts the run again", "")
            return PREEMPTED_EXIT
        if not filt.errors:
            _say(f"the run was stopped by {report['signal']} (exit code {rc})")
        return rc
    if report["exitcode"] == 2:  # a refusal, said by the worker in one line
        return 2
    if filt.errors:  # the worker said why (e.g. a full disk); the others died of the lost connection
        return rc
    rank, pid = report["rank"], report["pid"]
    if report["signal"]:
        _say(f"rank {rank} (pid {pid}) was killed by {report['signal']}; the job stopped (exit code {rc})")
    else:
        sys.stderr.buffer.write(b"".join(filt.tracebacks.get(rank, [])) + b"\n")  # a bug: its traceback
        _say(f"rank {rank} (pid {pid}) failed with exit code {report['exitcode']}; the job stopped (exit code {rc})")
    return rc


def _say(message: str, prefix: str = "error: ") -> None:
    from rich.console import Console  # the CLI's stderr console, made here: cli_helpers imports this module

    Console(stderr=True, soft_wrap=True).print(
        f"{prefix}{message}", style="red" if prefix else "yellow", highlight=False, markup=False
    )
