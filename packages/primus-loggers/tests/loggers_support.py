"""Read back what was logged: core's ``metrics.jsonl``, and a W&B offline run's ``run-<id>.wandb`` file.

wandb 0.30 has no reader of its own for offline runs (``wandb sync`` only uploads), so the file is read here: a
LevelDB-style log (a 7-byte header ``:W&B``, magic 0xBEE1, version; then 32 KiB blocks of chunks, each a CRC32,
a length and a type: full, first, middle, last) whose records are ``wandb_internal_pb2.Record`` protobufs.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
CHUNK_HEADER = 7  # crc32 (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def jsonl_rows(out: Path) -> dict[int, dict[str, float]]:
    """``metrics.jsonl`` by step, without ``step`` and ``time``: what each logger must have at that step."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row.pop("step"): {k: v for k, v in row.items() if k != "time"} for row in rows}


def same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # NaN equals NaN here


def wandb_records(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B transaction log"
    records, payload, pos = [], b"", 7
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a chunk is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if pos + CHUNK_HEADER + length > len(data):  # still being written
            break
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: bad checksum at byte {pos}"
        payload += chunk
        pos += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


@dataclass
class WandbRun:
    """What one offline W&B run holds: its id, project, name, config, history by step, summary and exit code."""

    id: str = ""
    project: str = ""
    name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: dict[int, dict[str, Any]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None


def _key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def read_wandb_run(run_dir: Path) -> WandbRun:
    """``run_dir``: ``<dir>/wandb/offline-run-<time>-<id>``."""
    (path,) = run_dir.glob("run-*.wandb")
    run = WandbRun()
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.id, run.project, run.name = record.run.run_id, record.run.project, record.run.display_name
            run.config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run.config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            run.history[record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "summary":
            run.summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def wandb_runs(out: Path, timeout: float = 30.0) -> list[WandbRun]:
    """The offline W&B runs of run folder ``out``, oldest first, once each is finished: ``run.finish()`` returns
    before wandb's service has written the whole file (it does at the latest when the process exits)."""
    deadline = time.monotonic() + timeout
    while True:
        runs = [read_wandb_run(d) for d in sorted((out / "wandb").glob("offline-run-*"))]
        if all(run.exit_code is not None for run in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.1)
