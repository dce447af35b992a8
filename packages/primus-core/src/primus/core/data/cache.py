"""Where the data layer keeps what it builds, and how several ranks share it without corrupting it.

Every file is written to a temporary name in its final folder and renamed into place (atomic on POSIX and
Windows), so a reader sees a whole file or none. A lock file (``fcntl.flock`` where available) lets the first
rank build while the others wait and then reuse the result; without ``fcntl`` each rank builds and the last
rename wins, which is still correct because the content is deterministic.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]


def cache_root() -> Path:
    """``$PRIMUS_CACHE`` or ``~/.cache/primus``."""
    return Path(os.environ.get("PRIMUS_CACHE") or Path.home() / ".cache" / "primus").expanduser()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` (released by the OS if the holder dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a+b") as handle:
        locked = False
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX)
                locked = True
            except OSError:  # a filesystem without flock (some network mounts): atomic renames still hold
                pass
        try:
            yield
        finally:
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(folder: Path, build: Callable[[Path], object]) -> Path:
    """``build(folder)`` unless a finished build is there, under :func:`file_lock`: of several processes the first
    builds and the others wait, then read it; a build that died part way (no ``.built`` mark) is cleared and redone."""
    with file_lock(folder):
        if not (folder / ".built").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            (folder / ".built").touch()
    return folder


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary file next to ``path``, then rename it onto ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; cache entries are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
