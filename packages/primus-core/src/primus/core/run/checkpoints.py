"""Checkpoint bookkeeping shared by the backends: the manifest, which folders are complete checkpoints,
the newest one, keep-last-N, and the model-shape check before loading.

A save is atomic: every rank writes into ``<name>.tmp``; after all ranks are done (a barrier), rank 0
writes the manifest (``manifest.json``: step, config hash, model shape, layout, versions, time, and every
file of the checkpoint with its size and checksum) last, then renames the folder to ``<name>``. So a
checkpoint is complete exactly when its folder has its final name and holds a manifest of its step; resume
takes the newest complete one, and a partial folder (a rank killed mid-save leaves a ``.tmp`` without
manifest) never shadows it. Partial folders stay for inspection until the next complete save removes those
of its step or earlier; ``keep_last`` counts complete checkpoints only. Resume refuses a checkpoint of
another model shape, naming both.

A complete checkpoint can still be broken afterwards (a file truncated, deleted or overwritten on disk):
:func:`verify` compares its files with the manifest's record. Readers take the newest complete checkpoint that
verifies (:func:`newest_verified`), warn about each newer one that does not, naming the file, and refuse, naming
the files, when none does. A checkpoint written before manifests recorded their files verifies with a warning.

The engines write the files (``write`` below); every checkpoint folder is named by :data:`NAMING`.
This module imports neither torch nor an engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from primus.core.config.schema import SHAPE_KEYS, PrimusConfig
from primus.core.contracts.errors import UserError

log = logging.getLogger("primus.core.run.checkpoints")

MANIFEST = "manifest.json"
TMP_SUFFIX = ".tmp"


class CheckpointMismatch(UserError, ValueError):
    """A checkpoint that this run's model cannot load (the user's to fix: exit 2, no traceback)."""


class CheckpointBroken(UserError, ValueError):
    """A checkpoint whose files are not what its manifest records, or a folder that is no committed checkpoint."""


@dataclass(frozen=True)
class Naming:
    """A backend's step-folder names: ``template.format(step=N)``, recognised by ``pattern`` (group 1: N)."""

    template: str
    pattern: re.Pattern[str]

    def folder(self, root: Path, step: int) -> Path:
        return root / self.template.format(step=step)

    def step_of(self, name: str) -> int | None:
        m = self.pattern.match(name)
        return int(m.group(1)) if m else None

    def tmp_step_of(self, name: str) -> int | None:
        return self.step_of(name.removesuffix(TMP_SUFFIX)) if name.endswith(TMP_SUFFIX) else None


# One folder scheme for every engine: zero-padded, so a listing sorts by step.
NAMING = Naming("step_{step:08d}", re.compile(r"^step_(\d{8})$"))


def tmp_folder(final: Path) -> Path:
    return final.with_name(final.name + TMP_SUFFIX)


def model_shape(cfg: PrimusConfig) -> dict[str, Any]:
    return {k: getattr(cfg.model, k) for k in SHAPE_KEYS}


def config_hash(cfg: PrimusConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def manifest(cfg: PrimusConfig, step: int, layout: dict[str, int], distributions: Iterable[str]) -> dict[str, Any]:
    """What a checkpoint says about itself; written last, so its presence marks a complete save."""
    return {
        "step": step,
        "backend": cfg.backend.name,
        "config_hash": config_hash(cfg),
        "model_name": cfg.model.name,
        "model_shape": model_shape(cfg),
        "layout": layout,
        "versions": {d: _version(d) for d in distributions},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def weights_only(cfg: PrimusConfig, init_from: str | None = None) -> dict[str, Any]:
    """The ``weights_only`` record of a checkpoint holding a model's weights alone (``train.save_initial``, ``primus
    checkpoint import``): what decided them (the shape, the seed and init, the folder they came from)."""
    t = cfg.train
    return {"model_shape": model_shape(cfg), "seed": t.seed, "init": t.init, "init_from": init_from or t.init_from}


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def complete_checkpoints(root: Path, naming: Naming) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = naming.step_of(p.name)
        if step is None or not p.is_dir():
            continue
        man = read_manifest(p)
        if man is not None and man.get("step") == step:
            found.append((step, p))
        else:
            log.warning("ignoring %s: no manifest of its step (an incomplete save)", p)
    return sorted(found)


def latest(root: Path, naming: Naming, *, checksums: bool = False) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root`` whose files verify (sizes; also their checksums, which reads
    every file, with ``checksums``); a warning for each newer one that does not. None when none does."""
    try:
        return newest_verified(complete_checkpoints(root, naming), lambda f: verify(f, checksums=checksums))
    except CheckpointBroken:  # already named, one warning per checkpoint
        return None


# -- the files of a checkpoint ---------------------------------------------------------------------------------
# A checksum finds a same-size overwrite that the size does not. blake2b: the faster of the stdlib's strong hashes
# (measured on one core: 270 MiB/s, sha256 180); zlib.crc32 is faster still, but collides by chance. Files are read
# in 8 MiB chunks, a few at a time (hashlib releases the GIL), each rank its share of the files.
CHECKSUM = "blake2b"
_CHUNK = 8 * 2**20
_THREADS = 4
_SIDECAR = re.compile(r"^\.files\.rank(\d+)\.json$")  # a rank's share of the file records, merged by rank 0
_unrecorded_warned: set[Path] = set()


def _sidecar(tmp: Path, rank: int) -> Path:
    return tmp / f".files.rank{rank}.json"


def _listing(folder: Path) -> list[str]:
    """The checkpoint's files (relative POSIX paths, sorted): everything but the manifest and the sidecars."""
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name != MANIFEST and not (p.parent == folder and _SIDECAR.match(p.name))
    )


def _record(path: Path) -> dict[str, Any]:
    h, size = hashlib.blake2b(), 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return {"bytes": size, CHECKSUM: h.hexdigest()}


def records(folder: Path, files: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Size and checksum of each of ``files`` (relative to ``folder``)."""
    if len(files) <= 1:
        return {f: _record(folder / f) for f in files}
    with ThreadPoolExecutor(min(_THREADS, len(files))) as pool:
        return dict(zip(files, pool.map(lambda f: _record(folder / f), files), strict=True))


def atomic_save(
    final: Path,
    man: dict[str, Any],
    rank: int,
    write: Callable[[Path], None],
    barrier: Callable[[], None],
    world: int = 1,
    naming: Naming = NAMING,
) -> None:
    """Every rank calls ``write(tmp)`` (its own files into the temporary folder); then the ranks record the files
    (size and checksum), rank 0 writes the manifest with them and renames the folder to ``final``. Returns on every
    rank once the checkpoint is committed.

    The checksums are split over the ranks (``world`` of them call this; 1: rank 0 reads every file): rank ``r``
    reads the files whose index in the sorted listing is ``r`` modulo ``world`` and writes their records to a
    sidecar; rank 0 merges the sidecars into the manifest and records itself any file no sidecar has (a rank whose
    listing lagged the shared file system's), so the manifest lists every file rank 0 sees. A save that fails on a
    full file system removes its temporary folder and raises :class:`primus.core.run.disk.NoSpaceLeft` (one line)."""
    tmp = tmp_folder(final)
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial save of the same step by a run that died
            tmp.mkdir(parents=True)
        barrier()
        write(tmp)
        barrier()  # every rank's files are on disk
        mine = records(tmp, [f for i, f in enumerate(_listing(tmp)) if i % world == rank])
        if rank != 0:
            _sidecar(tmp, rank).write_text(json.dumps(mine))
        barrier()  # every rank's records are on disk
        if rank == 0:
            files = dict(mine)
            for p in sorted(tmp.iterdir()):
                if _SIDECAR.match(p.name):
                    files.update(json.loads(p.read_text()))
                    p.unlink()
            files |= records(tmp, [f for f in _listing(tmp) if f not in files])
            (tmp / MANIFEST).write_text(json.dumps({**man, "files": dict(sorted(files.items()))}, indent=1))
            shutil.rmtree(final, ignore_errors=True)  # a folder of that name without a manifest
            tmp.rename(final)
    except BaseException as exc:  # (torch's CheckpointException is a BaseException)
        _no_space(exc, tmp, final, naming)
        raise
    barrier()


def _no_space(exc: BaseException, tmp: Path, final: Path, naming: Naming) -> None:
    """A save that failed on a full file system: remove its partial folder (the space goes back; the newest complete
    checkpoint was never touched) and raise one line naming the device, the folder and what can resume."""
    from primus.core.run.disk import no_space

    if (full := no_space(exc, [tmp, final.parent])) is None:
        return
    shutil.rmtree(tmp, ignore_errors=True)
    found = complete_checkpoints(final.parent, naming)
    kept = f"; {found[-1][1]} (step {found[-1][0]}) is intact: free space and resume" if found else ""
    raise type(full)(tmp, kept) from None


def verify(folder: Path, *, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with the checkpoint ``folder``, one line per file naming it: missing, another size, another
    checksum than the manifest records (files the manifest does not list are fine). Every file's size is checked;
    with ``share`` ``(r, n)`` only the checksums of the files whose index among the manifest's (sorted) is ``r``
    modulo ``n`` (a rank's part; the parts of ranks ``0..n-1`` cover them all). A folder without manifest is one
    problem; a checkpoint written before manifests recorded their files verifies, with a warning."""
    man = read_manifest(folder)
    if man is None:
        return [f"{folder}: no {MANIFEST} (an uncommitted or partial save)"]
    files: dict[str, dict[str, Any]] | None = man.get("files")
    if files is None:
        if folder not in _unrecorded_warned:
            _unrecorded_warned.add(folder)
            log.warning("%s was written before checkpoints recorded their files: its files are not verified", folder)
        return []
    rank, world = share
    problems: dict[str, str] = {}
    to_hash = []
    for i, (name, rec) in enumerate(sorted(files.items())):
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            problems[name] = f"{path}: missing"
            continue
        if size != rec["bytes"]:
            problems[name] = f"{path}: {size} bytes, the manifest records {rec['bytes']}"
        elif checksums and i % world == rank and CHECKSUM in rec:  # (another checksum: the size only)
            to_hash.append(name)
    for name, rec in records(folder, to_hash).items():
        if rec[CHECKSUM] != files[name][CHECKSUM]:
            problems[name] = f"{folder / name}: {CHECKSUM} checksum differs from the manifest's (the file was changed)"
    return [problems[n] for n in sorted(problems)]


def newest_verified(
    found: Sequence[tuple[int, Path]], check: Callable[[Path], list[str]] = verify, *, warn: bool = True
) -> tuple[int, Path] | None:
    """Of ``found`` ((step, folder), oldest first: :func:`complete_checkpoints`), the newest whose ``check`` finds no
    problem; a warning (with ``warn``) for each newer one, naming its problems. None when ``found`` is empty; a
    :class:`CheckpointBroken` naming every problem when none passes."""
    broken = []
    for step, folder in reversed(found):
        problems = check(folder)
        if not problems:
            return step, folder
        broken.append(f"step {step}: {'; '.join(problems)}")
        if warn:
            log.warning("checkpoint %s (step %d) is broken, taking an older one: %s", folder, step, "; ".join(problems))
    if broken:
        raise CheckpointBroken(f"no checkpoint verifies ({'; '.join(broken)})")
    return None


def readable(path: Path, naming: Naming = NAMING) -> Path:
    """The checkpoint to read at ``path``: ``path`` itself, a committed checkpoint that verifies (checksums too), or
    the newest such under it. :class:`CheckpointBroken` naming the files when it does not verify, or naming the
    folder when it has no manifest (an uncommitted or partial save) and holds no complete checkpoint."""
    if read_manifest(path) is not None:
        if problems := verify(path):
            raise CheckpointBroken(f"checkpoint {path} is broken: {'; '.join(problems)}")
        return path
    found = complete_checkpoints(path, naming)
    if not found:
        raise CheckpointBroken(
            f"{path} is no committed checkpoint (no {MANIFEST}: an uncommitted or partial save) and holds none"
        )
    try:
        return newest_verified(found)[1]
    except CheckpointBroken as exc:
        raise CheckpointBroken(f"{path}: {exc}") from None


def purge(root: Path, naming: Naming, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; remove partial saves (``.tmp``) of the newest
    complete step or earlier (a later complete checkpoint supersedes them). Call on one rank."""
    found = complete_checkpoints(root, naming)
    if not found:
        return
    for _, old in found[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    newest = found[-1][0]
    for p in root.iterdir():
        step = naming.tmp_step_of(p.name)
        if step is not None and step <= newest:
            shutil.rmtree(p, ignore_errors=True)


def check_compatible(path: Path, cfg: PrimusConfig, backend: str) -> dict[str, Any]:
    """The manifest of ``path``; refuses a checkpoint of another model shape, naming both, and one with a file
    missing or of another size than its manifest records, naming it."""
    man = read_manifest(path)
    if man is None:
        raise CheckpointMismatch(f"{path} has no {MANIFEST}: not a complete {backend} checkpoint")
    ours = model_shape(cfg)
    theirs = man.get("model_shape", {})
    if theirs != ours:
        diff = ", ".join(f"{k} {theirs.get(k)} vs {ours[k]}" for k in SHAPE_KEYS if theirs.get(k) != ours[k])
        raise CheckpointMismatch(
            f"checkpoint {path} holds a model of another shape ({diff}): checkpoint "
            f"{man.get('model_name')} {theirs}, this run {cfg.model.name} {ours}"
        )
    if problems := verify(path, checksums=False):  # a stat per file: a truncated or missing file, before the load
        raise CheckpointBroken(f"checkpoint {path} is broken: {'; '.join(problems)}")
    saved = man.get("versions", {})
    mine = {d: _version(d) for d in saved}
    if mine != saved:
        log.warning("checkpoint %s was written with %s; this run has %s", path, saved, mine)
    return man


# -- the data order ---------------------------------------------------------------------------------------------
# A checkpoint records what decides its run's data order (manifest key "data": primus.core.data.fingerprint); a
# resume over other data files, another seed, sequence length or holdout would continue over another order unsaid.
DATA_KEY = "data"
#: the manifest key of a checkpoint ``primus checkpoint import --from`` wrote: where its state came from
IMPORTED = "imported"


def check_data_order(path: Path, man: dict[str, Any], now: dict[str, Any], allow: bool, *, warn: bool = True) -> None:
    """Refuses resuming ``path`` (its manifest ``man``) when this run's data fingerprint ``now`` differs from the
    one it records, naming each change (old and new); with ``allow`` (``checkpoint.allow_data_change``) a warning
    names them instead, but a changed ``train.global_batch_size`` is always refused: the data position is the step
    times the global batch. A checkpoint that records none (written before Primus recorded them) resumes with a
    warning that nothing was compared."""
    from primus.core.data import fingerprint as fp

    saved = man.get(DATA_KEY)
    if saved is None and IMPORTED in man:
        if warn:
            log.warning(
                "checkpoint %s was imported from %s: this run's data order starts at step %s of its own data, not "
                "the source run's",
                path,
                man[IMPORTED].get("what", man[IMPORTED].get("source")),
                man.get("step"),
            )
        return
    if saved is None or saved.get("version") != fp.VERSION:
        if warn:
            log.warning(
                "checkpoint %s records no data fingerprint (written by an earlier Primus): its data files, "
                "train.seed and train.global_batch_size are not compared with this run's",
                path,
            )
        return
    found = fp.changes(saved, now)
    if found and found[0].startswith(fp.SETTINGS[0]):
        raise CheckpointMismatch(
            f"cannot resume {path}: {found[0]}: a resumed run continues at step × global batch; resume with the "
            f"checkpoint's train.global_batch_size, or start a new run from its weights (train.init_from={path})"
        )
    if found and not allow:
        raise CheckpointMismatch(
            f"cannot resume {path}: its data order would change: {'; '.join(found)} (resume with the checkpoint's "
            "data and settings, or set checkpoint.allow_data_change=true to continue on these)"
        )
    if warn:
        for change in found:
            log.warning("checkpoint.allow_data_change: resuming %s although %s", path, change)
        for note in fp.notes(saved, now):
            log.warning("resuming %s: %s", path, note)


def has_complete_checkpoint(root: Path) -> bool:
    """Whether ``root`` holds a committed checkpoint: a folder named by :data:`primus.core.run.checkpoints.NAMING`
    (what core's loop writes) with its manifest, or, for a backend that runs its own loop under another naming, any
    folder whose manifest records its step."""
    if complete_checkpoints(root, NAMING):  # committed (whether it verifies is the resume's to say)
        return True
    if not root.is_dir():
        return False
    return any(
        p.is_dir() and not p.name.endswith(TMP_SUFFIX) and "step" in (read_manifest(p) or {}) for p in root.iterdir()
    )
