"""What a full file system is called in an error: a write that failed for want of space (or quota) becomes
:class:`NoSpaceLeft`, one line naming the device and the path (:func:`no_space`)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from primus.core.contracts.errors import UserError

#: Free bytes under which a file system counts as full when a write failed without saying why (torch's writer:
#: ``[enforce fail at inline_container.cc] ... file write failed``).
FULL_BELOW = 1 << 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class NoSpaceLeft(UserError):
    """A write failed on a full file system (or quota): one line naming the device and the path. Exits 1: the run
    failed (nothing in its config is wrong)."""

    exit_code = 1

    def __init__(self, path: Path | str, detail: str = "") -> None:
        self.path = Path(path)
        device, mount = device_of(self.path)
        where = f"{device} (mounted at {mount})" if mount else device
        super().__init__(f"no space left on {where} for {path}{detail}")


def device_of(path: Path) -> tuple[str, str | None]:
    """(device, mount point) of the file system holding ``path`` (its nearest existing parent), from
    ``/proc/self/mounts``; ``("device", None)`` where that cannot be read."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    p = p.resolve()
    best: tuple[str, str] | None = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            device, mount = line.split()[:2]
            mount = mount.replace("\\040", " ")
            if (p == Path(mount) or Path(mount) in p.parents) and (best is None or len(mount) >= len(best[1])):
                best = (device, mount)
    return best or ("device", None)


def _free(path: Path) -> int | None:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def no_space(exc: BaseException, candidates: list[Path]) -> NoSpaceLeft | None:
    """``exc`` as a :class:`NoSpaceLeft` when it comes from a full file system, else None. The path is the one the
    error names, else the first of ``candidates`` (the folders the failing code wrote to) whose file system is full.
    Full: ``ENOSPC`` / ``EDQUOT`` anywhere in the exception's chain or message, or any failure (such as torch's
    ``[enforce fail at inline_container.cc]``, wrapped by its distributed checkpoint in a ``CheckpointException``)
    while a candidate has under 1 MiB free."""
    if isinstance(exc, NoSpaceLeft):
        return exc
    said = False
    named: str | None = None
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            said, named = True, named or e.filename
        elif "No space left on device" in str(e) or "Disk quota exceeded" in str(e) or "os error 28" in str(e):
            said = True
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return None
    full = next((p for p in candidates if (free := _free(p)) is not None and free < FULL_BELOW), None)
    if named:
        return NoSpaceLeft(named)
    if full is not None:
        return NoSpaceLeft(full)
    if said:
        return NoSpaceLeft(candidates[0] if candidates else "a file")
    return None
