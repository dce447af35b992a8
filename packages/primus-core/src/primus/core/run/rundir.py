"""Where a run writes: its output folder and its checkpoint folder; the lock that makes one run its only writer;
what a full file system is called in an error.

The lock is ``fcntl.flock`` on ``<output_dir>/.primus.lock``: the OS releases it when its holder dies (a killed run
leaves no stale lock; the file stays, naming the last holder). The file is never removed, so two runs can never
lock two different files of the same name."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import time
from pathlib import Path

from primus.core.config.errors import ConfigError
from primus.core.config.schema import PrimusConfig
from primus.core.contracts.errors import UserError
from primus.core.contracts.protocols import ConfigIssue

try:
    import fcntl
except ImportError:  # Windows: no lock, as before
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".primus.lock"
#: Set by core's launcher for its workers when it holds the output folder's lock for the whole job.
LOCK_HELD_ENV = "PRIMUS_RUN_LOCK_HELD"


def output_dir(cfg: PrimusConfig) -> Path:
    """``logging.output_dir`` (a recipe or config file sets its default, ``outputs/<its name>``, on load); for a
    config built from overrides alone ``outputs/<model.name>``: then ``model.name`` must be one plain folder name
    (``../../x`` or ``a/b`` would put the run elsewhere), else :class:`ConfigError` (exit 2)."""
    if cfg.logging.output_dir:
        return Path(cfg.logging.output_dir)
    name = cfg.model.name
    if name in ("", ".", "..") or re.search(r"[/\\\x00-\x1f]", name):
        why = "names the run folder outputs/<model.name> (logging.output_dir is unset) and is not one plain folder name"
        allowed = "a name without / or \\ (not . or ..), or set logging.output_dir"
        raise ConfigError([ConfigIssue("model.name", why, name, allowed)])
    return Path("outputs") / name


def checkpoint_root(cfg: PrimusConfig) -> Path:
    """``checkpoint.dir``, by default ``<output_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else output_dir(cfg) / "checkpoints"


# -- one writer per output folder --------------------------------------------------------------------------------


class FolderInUse(UserError):
    """Another live run holds the output folder's lock."""


_held: dict[Path, int] = {}  # output folder (resolved) -> the fd of its lock, held by this process


def _in_use(out: Path, lock: Path) -> FolderInUse:
    try:
        holder = lock.read_text().strip()
    except OSError:
        holder = ""
    return FolderInUse(
        f"logging.output_dir {out} is in use by another run ({holder or 'its holder has not written its name yet'}); "
        "wait for it to end (or stop it), or choose another logging.output_dir"
    )


def hold(out: Path) -> int | None:
    """Lock ``out`` (created if missing) for this process until :func:`release` or its end, and write who holds it
    (pid, host, start time) into the lock file; :class:`FolderInUse` naming the holder when another run has it.
    Returns the lock's fd (a child given it keeps the lock alive), None where there is no ``fcntl``."""
    key = out.resolve()
    if key in _held:
        return _held[key]
    if fcntl is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    lock = out / LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _in_use(out, lock) from None
    except OSError:  # a file system without flock (some network mounts): run unlocked, as before
        os.close(fd)
        return None
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode(), 0)
    _held[key] = fd
    return fd


def check_free(out: Path) -> None:
    """:class:`FolderInUse` when another run holds ``out``'s lock; creates nothing (a refusal before the run folder
    exists leaves none)."""
    lock = out / LOCK_NAME
    if fcntl is None or out.resolve() in _held or not lock.is_file():
        return
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(out, lock) from None
    except OSError:
        pass
    finally:
        os.close(fd)  # also releases the shared lock


def release(out: Path) -> None:
    fd = _held.pop(out.resolve(), None)
    if fd is not None:
        os.close(fd)


def relock(out: Path) -> None:
    """After ``out`` was removed under a run that holds it: take the lock again on the new folder (the old lock went
    with its file)."""
    key = out.resolve()
    if _held.get(key) is None:
        return
    old = _held.pop(key)
    try:
        hold(out)
    finally:
        os.close(old)


# -- a full file system ------------------------------------------------------------------------------------------

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
