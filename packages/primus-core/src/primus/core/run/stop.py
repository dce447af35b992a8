"""Stopping early and cleanly: preemption signals and the wall-clock limit.

SIGTERM and SIGUSR1 (what Slurm sends before a time limit or a preemption, ``sbatch --signal``) and
``train.max_minutes`` ask the run to stop. The step in flight finishes on every rank; then every rank agrees (one
small all-reduce per step, since a signal reaches the ranks at different times), one checkpoint is written and
committed, and the process exits with :data:`PREEMPTED_EXIT`. ``checkpoint.resume: auto`` makes the same command
continue from that checkpoint (``primus slurm script`` requeues the job with it).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("primus.stop")

#: The exit code of a run stopped by a signal or ``train.max_minutes`` after its checkpoint was committed
#: (EX_TEMPFAIL: try again later — the same command with ``checkpoint.resume: auto`` continues it).
PREEMPTED_EXIT = 75
SIGNALS = ("SIGTERM", "SIGUSR1")
#: What torchrun must handle and forward to its workers (its option ``--signals-to-handle``): its own defaults and
#: the stop signals.
TORCHRUN_SIGNALS = ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *SIGNALS]))
_pending: str | None = None  # a stop signal received before the loop listened (see listen_early)


@contextlib.contextmanager
def listen_early() -> Iterator[None]:
    """Record a stop signal while in this block (``primus train`` runs in it): one that arrives while the run starts
    (config, engine build, resume) stops it after its first step, with a checkpoint, as it would later, instead of
    killing the process (exit 143, and on several ranks a torchrun failure). The handlers before it come back."""

    def record(num: int, frame: Any) -> None:
        global _pending
        if _pending is None:
            _pending = signal.Signals(num).name
            log.warning("%s received while the run starts: it stops after its first step, with a checkpoint", _pending)

    previous = {}
    for name in SIGNALS:
        num = getattr(signal, name)
        try:
            previous[num] = signal.signal(num, record)
        except ValueError:  # not the main thread
            pass
    try:
        yield
    finally:
        for num, handler in previous.items():
            signal.signal(num, handler)


def pending() -> str | None:
    """The stop signal received before the loop listened, if any."""
    return _pending


class StopRequest:
    """Set by a stop signal or the wall-clock limit; :meth:`agreed` says, the same on every rank, whether to stop."""

    def __init__(self, max_minutes: float | None, world_size: int) -> None:
        self.reason: str | None = None
        self.world_size = world_size
        self.deadline = time.monotonic() + 60 * max_minutes if max_minutes else None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        global _pending
        self.reason, _pending = self.reason or _pending, None
        for name in SIGNALS:
            num = getattr(signal, name)
            try:
                self._previous[num] = signal.signal(num, self._on_signal)
            except ValueError:  # not the main thread (a test's runner): signals stay as they were
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for num, handler in self._previous.items():
            signal.signal(num, handler)

    def _on_signal(self, num: int, frame: Any) -> None:
        if self.reason is None:
            self.reason = signal.Signals(num).name
            log.warning("%s received: stopping after this step, with a checkpoint", self.reason)

    def agreed(self) -> str | None:
        """The reason to stop now (a signal's name or ``train.max_minutes``) when any rank has one, else None."""
        if self.reason is None and self.deadline is not None and time.monotonic() >= self.deadline:
            self.reason = "train.max_minutes"
        reason = self.reason
        if self.world_size > 1 and _any_rank(reason is not None):
            reason = reason or "another rank's stop request"
        return reason


def _any_rank(flag: bool) -> bool:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return flag
    device = "cuda" if "nccl" in str(dist.get_backend()) and torch.cuda.is_available() else "cpu"
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
