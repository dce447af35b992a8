"""A run that ran out of device memory ends in one line: where (the step), the memory in use, the planner's estimate
and what to type instead (filled in by the launcher, :func:`primus.core.launch.rank.run_rank`), the last checkpoint
(left as it was: nothing is saved from a step that failed half way), and its own exit code, :data:`OOM_EXIT`, on
every rank count (the launcher prefers it, like a refusal, over the lost-connection failures of the other ranks).
No torch import at module level."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from primus.core.contracts.errors import UserError

#: the exit code of a run that ran out of device memory (as ``primus plan``'s "nothing fits")
OOM_EXIT = 3


class OutOfMemory(UserError):
    """The one line of a run that ran out of memory. ``estimate`` and ``instead`` are the planner's, added by the
    launcher, which knows the device and the run's words."""

    exit_code = OOM_EXIT

    def __init__(self, where: str, in_use: str, checkpoint: Path | None) -> None:
        self.where, self.in_use, self.checkpoint = where, in_use, checkpoint
        self.estimate: str | None = None
        self.instead: str | None = None
        super().__init__(where)

    def __str__(self) -> str:
        text = f"out of memory {self.where}: {self.in_use}"
        if self.estimate:
            text += f"; the memory model estimated {self.estimate}"
        if self.checkpoint is not None:
            text += f"; the last checkpoint, {self.checkpoint}, is intact (--resume continues from it)"
        else:
            text += "; no checkpoint was written before it"
        if self.instead:  # last: its words copy as they are
            text += f"; {self.instead}"
        return text


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is the device or the host running out of memory:
    torch's ``OutOfMemoryError`` (CUDA and ROCm), a runtime error that says so (an engine's or NCCL's), ``MemoryError``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
            return True
        if isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def in_use(device: str) -> str:
    """The memory in use now, as a person reads it: the device's (all processes) and the peak torch allocated, or on a
    CPU the process's peak resident set."""
    try:
        import torch

        if device != "cpu" and torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            peak = torch.cuda.max_memory_allocated() / 2**30
            return f"{(total - free) / 2**30:.2f} of {total / 2**30:.2f} GiB in use on the device ({peak:.2f} GiB peak allocated by torch)"
    except (ImportError, RuntimeError):
        pass
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return f"{rss:.2f} GiB peak resident in this process"


class Where:
    """What the loop is doing, for the line: ``at`` updates it; :meth:`watch` turns an out-of-memory error raised
    inside it into :class:`OutOfMemory`."""

    def __init__(self, device: str, last_checkpoint) -> None:
        self.now = "while building the engine"
        self.device, self.last_checkpoint = device, last_checkpoint

    def at(self, now: str) -> None:
        self.now = now

    @contextlib.contextmanager
    def watch(self, rank: int) -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, OutOfMemory) or not is_oom(exc):
                raise
            where = f"{self.now} on rank {rank}"
            raise OutOfMemory(where, in_use(self.device), self.last_checkpoint()) from None
