"""Where a run writes, and the rules of that folder in one place (:class:`RunFolder`): its output folder and its
checkpoint folder; whether a run may start there (writable, not another live run's, no earlier run's results unless
resumed); the lock that makes one run its only writer; the config it records (a full file system's error:
:mod:`primus.core.run.disk`).

The lock is ``fcntl.flock`` on ``<output_dir>/.primus.lock``: the OS releases it when its holder dies (a killed run
leaves no stale lock; the file stays, naming the last holder). The file is never removed, so two runs can never
lock two different files of the same name."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from primus.core.config.errors import ConfigError
from primus.core.config.schema import PrimusConfig
from primus.core.config.validate import folder_issue
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


class RunFolder:
    """The folder of the run of ``cfg`` (:func:`output_dir`, its checkpoints :func:`checkpoint_root`) and every rule
    about it: what the launcher checks before anything is written (:meth:`check`), the one-writer lock
    (:meth:`claim`, :meth:`release`), the config the run records, what an earlier run left there (:meth:`earlier`,
    :meth:`has_checkpoint`), and a write that failed on a full file system as one line (:meth:`one_line_if_full`)."""

    #: what an earlier run leaves (a fresh run is refused there; ``--resume`` continues it)
    EARLIER = ("metrics.jsonl", "summary.json", "checkpoints")

    def __init__(self, cfg: PrimusConfig) -> None:
        self.cfg = cfg
        self.path = output_dir(cfg)
        self.checkpoints = checkpoint_root(cfg)

    def check(self, resume: bool) -> None:
        """Before anything is written: a folder the run can create and write (:meth:`check_writable`), that no live
        run holds (:func:`check_free`: creates nothing), holding no earlier run's results unless ``resume``
        (:meth:`check_unused`)."""
        self.check_writable()
        check_free(self.path)
        self.check_unused(resume)

    def check_writable(self) -> None:
        """:class:`ConfigError` (exit 2) for a run folder the run could not create or write: ``logging.output_dir``
        and, where checkpoints are saved, ``checkpoint.dir``."""
        issues = [issue] if (issue := folder_issue("logging.output_dir", self.path)) else []
        # the default checkpoint folder lies in the output folder: one mistake, one message
        if self.cfg.checkpoint.enabled and (self.cfg.checkpoint.dir or not issues):
            issues += [issue] if (issue := folder_issue("checkpoint.dir", self.checkpoints)) else []
        if issues:
            raise ConfigError(issues)

    def earlier(self) -> list[str]:
        """What an earlier run left here (of :data:`EARLIER`, the non-empty ones)."""
        return [n for n in self.EARLIER if (self.path / n).exists() and not _empty_dir(self.path / n)]

    def check_unused(self, resume: bool) -> None:
        """Refuse a fresh run in a folder that holds an earlier run's results (nothing is overwritten); ``resume``
        (``--resume`` or ``checkpoint.resume``) continues it instead."""
        if (found := self.earlier()) and not (resume or self.cfg.checkpoint.resume):
            raise UserError(
                f"logging.output_dir {self.path} holds an earlier run ({', '.join(found)}); pass --resume to "
                "continue it, or choose another logging.output_dir"
            )

    def claim(self, resume: bool) -> int | None:
        """Lock the folder for this run (:func:`hold`: refused, naming the holder, while another run writes there),
        then check it again under the lock (:meth:`check_unused`). The lock's fd."""
        fd = hold(self.path)
        try:
            self.check_unused(resume)
        except BaseException:
            release(self.path)
            raise
        return fd

    def release(self) -> None:
        release(self.path)

    def write_config(self, cfg: PrimusConfig) -> None:
        """``config.yaml``: the resolved config the run trains (an export or a resume reads it back)."""
        import yaml

        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))

    def drop_if_only_lock(self) -> None:
        """A launcher's folder whose ranks refused the run: only its lock is there, so nothing stays."""
        if self.path.is_dir() and [p.name for p in self.path.iterdir()] == [LOCK_NAME]:
            (self.path / LOCK_NAME).unlink()
            self.path.rmdir()

    def has_checkpoint(self) -> bool:
        from primus.core.run.checkpoints import has_complete_checkpoint

        return has_complete_checkpoint(self.checkpoints)

    def resume_warning(self) -> str | None:
        """What to tell a user who passed ``--resume`` when there is nothing to resume (None when there is): the run
        would start from step 0, which after a mistyped folder only costs their time, but should not pass unsaid."""
        if self.has_checkpoint():
            return None
        where = "does not exist" if not self.checkpoints.exists() else "holds no complete checkpoint"
        return (
            f"--resume: {self.checkpoints} {where}; this run starts from step 0, not from a checkpoint "
            "(check logging.output_dir / checkpoint.dir, or drop --resume to start fresh)"
        )

    @contextlib.contextmanager
    def one_line_if_full(self) -> Iterator[None]:
        """A write that failed on a full file system (the run folder, the checkpoints, the data cache, the temporary
        folder) becomes :class:`~primus.core.run.disk.NoSpaceLeft`: one line naming the device and the path."""
        try:
            yield
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # (torch's CheckpointException is a BaseException)
            import tempfile

            from primus.core.data.cache import cache_root
            from primus.core.run.disk import no_space

            folders = [self.path, self.checkpoints, cache_root(), Path(tempfile.gettempdir())]
            if (full := no_space(exc, folders)) is not None:
                raise full from None
            raise


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


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
