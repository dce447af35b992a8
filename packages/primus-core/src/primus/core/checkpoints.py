"""Checkpoint bookkeeping shared by the backends: the manifest, which folders are complete checkpoints,
the newest one, keep-last-N, and the model-shape check before loading.

A save is atomic: every rank writes into ``<name>.tmp``; after all ranks are done (a barrier), rank 0
writes the manifest (``manifest.json``: step, config hash, model shape, layout, versions, time) last,
then renames the folder to ``<name>``. So a checkpoint is complete exactly when its folder has its
final name and holds a manifest of its step; resume takes the newest complete one, and a partial folder
(a rank killed mid-save leaves a ``.tmp`` without manifest) never shadows it. Partial folders stay for
inspection until the next complete save removes those of its step or earlier; ``keep_last`` counts
complete checkpoints only. Resume refuses a checkpoint of another model shape, naming both.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from primus.core.config.schema import PrimusConfig
from primus.core.errors import UserError

log = logging.getLogger("primus.core.checkpoints")

MANIFEST = "manifest.json"
TMP_SUFFIX = ".tmp"
# What makes two models' checkpoints interchangeable (every layout of the same shape can load it).
SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "kv_channels",
    "ffn_hidden_size",
    "vocab_size",
    "tie_word_embeddings",
    "qkv_bias",
    "qk_norm",
)


class CheckpointMismatch(UserError, ValueError):
    """A checkpoint that this run's model cannot load (the user's to fix: exit 2, no traceback)."""


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


def latest(root: Path, naming: Naming) -> tuple[int, Path] | None:
    found = complete_checkpoints(root, naming)
    return found[-1] if found else None


def atomic_save(
    final: Path, man: dict[str, Any], rank: int, write: Callable[[Path], None], barrier: Callable[[], None]
) -> None:
    """Every rank calls ``write(tmp)`` (its own files into the temporary folder); then rank 0 writes the
    manifest and renames the folder to ``final``. Returns on every rank once the checkpoint is committed."""
    tmp = tmp_folder(final)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial save of the same step by a run that died
        tmp.mkdir(parents=True)
    barrier()
    write(tmp)
    barrier()  # every rank's files are on disk
    if rank == 0:
        (tmp / MANIFEST).write_text(json.dumps(man, indent=1))
        shutil.rmtree(final, ignore_errors=True)  # a folder of that name without a manifest
        tmp.rename(final)
    barrier()


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
    """The manifest of ``path``; refuses a checkpoint of another model shape, naming both."""
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
    saved = man.get("versions", {})
    mine = {d: _version(d) for d in saved}
    if mine != saved:
        log.warning("checkpoint %s was written with %s; this run has %s", path, saved, mine)
    return man
