"""What decides a run's data order, recorded in each checkpoint and compared on resume.

A resumed run continues at global batch ``step`` of the sample order; that order is a function of the data files,
the blend weights, ``train.seed``, ``train.global_batch_size``, ``train.seq_len`` (packing), ``eval.holdout`` and
(fine-tuning) ``data.sft_packing``. If any of them changed since the checkpoint, the run would go on over another
order without a word: some samples seen twice, others never. :func:`fingerprint` records them (JSON, in the
checkpoint's manifest); :func:`changes` names each difference between two.

Each data source (``data.source``, each ``data.paths`` entry, each ``data.blend`` entry) is fingerprinted from its
files: their count, total size, newest modification time and a checksum of each file's name, size, first and last
bytes (up to 1 MiB each, less for a source of many files: at most :data:`BUDGET` read per source). So an appended,
truncated or replaced file is found without reading the data; the bundled corpus by its own id. A source whose size
and sampled bytes are unchanged but whose files are newer (a copy to another file system) is the same data, said in
a note (:func:`notes`), as is the same data under another path.

Imports neither torch nor a tokenizer.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

from primus.core.data import corpus
from primus.core.data.documents import resolve_inputs

if TYPE_CHECKING:
    from primus.core.config.schema import PrimusConfig

#: Bump when the fingerprint's layout changes (an older one is then not compared, only noted).
VERSION = 1
#: Bytes read from each end of a file, at most; and at most in all per source (more files: fewer bytes each).
SAMPLE = 2**20
BUDGET = 64 * 2**20
_MIN_SAMPLE = 4096

# The run settings that move samples (besides the files), by config key; global batch first: no override takes it.
SETTINGS = ("train.global_batch_size", "train.seed", "train.seq_len", "eval.holdout", "data.sft_packing")


def fingerprint(cfg: PrimusConfig) -> dict[str, Any]:
    """The data order's inputs: the settings of :data:`SETTINGS` and one entry per data source (JSON)."""
    settings = {
        "train.global_batch_size": int(cfg.train.global_batch_size or 0),
        "train.seed": cfg.train.seed,
        "train.seq_len": cfg.train.seq_len,
        "eval.holdout": cfg.eval.holdout,
    }
    if cfg.train.objective == "sft":  # chats in samples: another layout is another sample order
        settings["data.sft_packing"] = cfg.data.sft_packing
    return {"version": VERSION, "settings": settings, "sources": _sources(cfg)}


def _sources(cfg: PrimusConfig) -> list[dict[str, Any]]:
    d = cfg.data
    if d.blend:
        return [
            {**_source(b.path, f"data.blend[{i}].path", d.format), "weight": b.weight} for i, b in enumerate(d.blend)
        ]
    if d.source == "mock":  # random tokens from train.seed; data.paths are unused
        return [_source("mock", "data.source", d.format)]
    return [_source(d.source, "data.source", d.format)] + [
        _source(p, f"data.paths[{i}]", d.format) for i, p in enumerate(d.paths)
    ]


def _source(spec: str, key: str, fmt: str) -> dict[str, Any]:
    if spec == "mock":  # random tokens from train.seed: nothing on disk
        return {"key": key, "path": spec}
    if spec == "bundled":
        return {"key": key, "path": spec, "corpus": corpus.corpus_id()}
    files = [f for item in resolve_inputs([(spec, key)], fmt) for f in item.files()]
    sample = max(_MIN_SAMPLE, min(SAMPLE, BUDGET // (2 * len(files))))
    h = hashlib.blake2b(digest_size=16)
    size = newest = 0
    for path in files:
        stat = path.stat()
        size += stat.st_size
        newest = max(newest, stat.st_mtime_ns)
        h.update(f"{path.name}\0{stat.st_size}\0".encode())
        with path.open("rb") as f:
            h.update(f.read(sample))
            if stat.st_size > sample:
                f.seek(max(sample, stat.st_size - sample))
                h.update(f.read(sample))
    mtime = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(newest / 1e9))
    return {"key": key, "path": spec, "files": len(files), "bytes": size, "mtime": mtime, "blake2b": h.hexdigest()}


def changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between the checkpoint's fingerprint ``saved`` and this run's ``now``, one phrase each naming the
    key, the checkpoint's value and this run's; in :data:`SETTINGS` order, then the sources."""
    out = []
    for key in SETTINGS:
        old, new = saved.get("settings", {}).get(key), now["settings"].get(key)
        if old is not None and old != new:
            out.append(f"{key} {old} in the checkpoint, {new} now")
    before = {s["key"]: s for s in saved.get("sources", [])}
    after = {s["key"]: s for s in now["sources"]}
    for key in [*before, *(k for k in after if k not in before)]:
        old, new = before.get(key), after.get(key)
        if new is None:
            out.append(f"{key} {old['path']} in the checkpoint, none now")
        elif old is None:
            out.append(f"{key} {new['path']} is new (not in the checkpoint)")
        elif old.get("weight") != new.get("weight"):
            out.append(f"{key[: -len('.path')]}.weight {old.get('weight')} in the checkpoint, {new.get('weight')} now")
        if old is not None and new is not None and _content(old) != _content(new):
            same = old["path"] == new["path"]
            name = f"{key} {new['path']}" if same else key
            out.append(f"{name} changed ({_describe(old, same)} in the checkpoint; {_describe(new, same)} now)")
    return out


def notes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Differences that leave the data the same (another path or modification time, the same size and sampled
    bytes), one phrase each."""
    before = {s["key"]: s for s in saved.get("sources", [])}
    out = []
    for new in now["sources"]:
        old = before.get(new["key"])
        if old is None or _content(old) != _content(new):
            continue
        if old["path"] != new["path"]:
            out.append(f"{new['key']} is {new['path']}, {old['path']} in the checkpoint (the same size and content)")
        elif old.get("mtime") != new.get("mtime"):
            out.append(
                f"{new['key']} {new['path']} was modified ({new['mtime']}, {old['mtime']} in the checkpoint) "
                "but has the same size and sampled content: taken as the same data"
            )
    return out


def _content(source: dict[str, Any]) -> tuple:
    return source.get("files"), source.get("bytes"), source.get("blake2b"), source.get("corpus")


def _describe(source: dict[str, Any], same_path: bool) -> str:
    parts = [] if same_path else [str(source["path"])]
    if "corpus" in source:
        parts.append(f"corpus {source['corpus']}")
    elif "bytes" in source:
        parts += [f"{source['files']} files"] if source["files"] != 1 else []
        parts += [f"{source['bytes']} bytes", f"modified {source['mtime']}"]
    return ", ".join(parts)
