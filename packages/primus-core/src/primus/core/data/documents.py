"""Finding input files and reading their documents (shared by :mod:`.sources` and :mod:`.prepare`).

Formats, chosen by extension when ``format`` is ``"auto"``:

- ``.jsonl``: one JSON object per line, the document is the string under ``text_key``; blank lines skipped.
- ``.json``: a JSON array of such objects.
- ``.txt``: the whole file is one document (split a corpus into several files for several documents).
- ``.parquet``: one document per row, column ``text_key`` (needs pyarrow); null cells skipped.
- ``.arrow``: the same, from Arrow IPC files read a batch at a time, memory-mapped (a Hugging Face ``datasets``
  folder written by ``save_to_disk`` is a folder of them; a ``DatasetDict`` folder is refused: name a split).
- Megatron ``<prefix>.bin/.idx``: already tokenized; named by the prefix, the ``.bin`` or the ``.idx`` path.

A folder stands for every supported file under it (recursively), a glob for its matches, both in sorted order;
the files that describe a ``datasets`` folder (:data:`DATASETS_METADATA`) are not data and are skipped.

:func:`iter_records` reads whole records (fine-tuning's, :mod:`.sft`) from the same files: a .jsonl line, a .json
array's element, a Parquet or Arrow row (a dict of its columns, null cells left out).
"""

from __future__ import annotations

import codecs
import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primus.core.data.errors import DataError
from primus.core.data.indexed import is_prefix

EXTENSIONS = {
    ".jsonl": "jsonl",
    ".json": "json",
    ".txt": "txt",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".bin": "megatron",
    ".idx": "megatron",
}
FORMATS = ("jsonl", "json", "txt", "parquet", "arrow", "megatron")
#: What Hugging Face ``datasets`` writes beside a folder's Arrow files (``save_to_disk``): metadata, not records.
DATASETS_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Input:
    """One input: a text file, or a Megatron prefix (``path`` without .bin/.idx) when format is megatron."""

    path: Path
    format: str

    def files(self) -> list[Path]:
        if self.format == "megatron":
            return [Path(f"{self.path}.bin"), Path(f"{self.path}.idx")]
        return [self.path]


def _from_file(path: Path, fmt: str, where: str) -> Input:
    if fmt == "auto":
        fmt = EXTENSIONS.get(path.suffix.lower(), "")
        if not fmt:
            raise DataError(
                f"{where}: cannot tell the format of {path} from its extension "
                f"(supported: {', '.join(EXTENSIONS)}; or set data.format)"
            )
    if fmt == "megatron":
        prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
        if not is_prefix(prefix):
            raise DataError(f"{where}: {path} is not half of a Megatron .bin/.idx pair ({prefix}.bin/.idx)")
        return Input(prefix, "megatron")
    return Input(path, fmt)


def _from_folder(folder: Path, fmt: str, where: str, text_only: bool) -> list[Input]:
    if (folder / "dataset_dict.json").is_file():  # a Hugging Face DatasetDict: one subfolder per split
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(
            f"{where}: {folder} is a Hugging Face DatasetDict (splits {', '.join(splits)}): name one split's "
            f"folder, e.g. {folder / (splits[0] if splits else 'train')}"
        )
    inputs: dict[Path, Input] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        kind = EXTENSIONS.get(path.suffix.lower())
        if kind is None or (fmt != "auto" and kind != fmt) or (text_only and kind == "megatron"):
            continue
        if path.name in DATASETS_METADATA:
            continue
        if kind == "megatron" and not is_prefix(path.with_suffix("")):
            continue  # a lone .bin/.idx inside a folder is skipped; named directly it is an error
        found = _from_file(path, kind, where)
        inputs.setdefault(found.path, found)  # .bin and .idx name the same prefix
    if not inputs:
        raise DataError(f"{where}: folder {folder} holds no {'supported' if fmt == 'auto' else fmt} files")
    return list(inputs.values())


def resolve_inputs(specs: list[tuple[str, str]], fmt: str = "auto", text_only: bool = False) -> list[Input]:
    """Expand ``(spec, where)`` pairs (a path, folder, glob or Megatron prefix; ``where`` names the config key
    for error messages) into inputs, in order, each once. ``text_only``: folders and globs skip .bin/.idx."""
    if fmt != "auto" and fmt not in FORMATS:
        raise DataError(f"data.format: unknown format {fmt!r} (auto, {', '.join(FORMATS)})")
    out: dict[tuple[Path, str], Input] = {}
    for spec, where in specs:
        path = Path(spec).expanduser()
        if any(ch in spec for ch in "*?["):
            matches = sorted(glob.glob(str(path), recursive=True))
            if not matches:
                raise DataError(f"{where}: no files match {spec!r}")
            found = []
            for match in map(Path, matches):
                if match.is_dir():
                    found += _from_folder(match, fmt, where, text_only)
                    continue
                kind = EXTENSIONS.get(match.suffix.lower()) if fmt == "auto" else fmt
                if match.name in DATASETS_METADATA:
                    continue
                if kind is not None and not (text_only and kind == "megatron"):
                    found.append(_from_file(match, fmt, where))
        elif path.is_dir():
            found = _from_folder(path, fmt, where, text_only)
        elif path.is_file():
            found = [_from_file(path, fmt, where)]
        elif fmt in ("auto", "megatron") and is_prefix(path):
            found = [Input(path, "megatron")]
        else:
            raise DataError(f"{where}: no such file, folder or Megatron prefix: {path}")
        for item in found:
            out.setdefault((item.path.resolve(), item.format), item)
    return list(out.values())


def iter_documents(item: Input, text_key: str = "text") -> Iterator[str]:
    """The documents of a text input, in file order."""
    if item.format in ("jsonl", "json"):
        for record, where in iter_records(item):
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{where}: no string field {text_key!r} (data.text_key / --text-key)")
            yield text
    elif item.format == "txt":
        try:
            yield item.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{item.path}: not UTF-8 text ({exc})") from exc
    elif item.format in ("parquet", "arrow"):
        yield from _column(item, text_key)
    else:
        raise DataError(f"{item.path}: {item.format} inputs hold tokens, not text")


def iter_records(item: Input) -> Iterator[tuple[Any, str]]:
    """The records of an input, in file order, each with where it is: a .jsonl file's lines (``path:line``; blank
    lines skipped), a .json file's array (``path: record i``), a Parquet or Arrow file's rows (``path: row i``, each
    a dict of its columns; a null cell, and a null field of a struct in it, is left out, as a table holds every
    record's keys)."""
    if item.format == "jsonl":
        yield from _jsonl(item.path)
    elif item.format == "json":
        yield from _json(item.path)
    elif item.format in ("parquet", "arrow"):
        read = _parquet_batches if item.format == "parquet" else _arrow_batches
        row = 0
        for batch in read(item.path, None):
            for record in batch.to_pylist():
                yield _present(record), f"{item.path}: row {row}"
                row += 1
    else:
        raise DataError(f"{item.path}: {item.format} inputs hold no records")


#: How much of a .txt file :func:`first_document` reads.
HEAD_BYTES = 1 << 16


def first_document(item: Input, text_key: str = "text") -> str | None:
    """The first non-empty document of a text input (of a .txt file: its first :data:`HEAD_BYTES`), or None if
    it has none. Reads only up to that document, so it is a cheap check of a large corpus: it raises what
    :func:`iter_documents` raises for the file's first records (not UTF-8, not JSON, no ``text_key``)."""
    if item.format == "txt":
        with open(item.path, "rb") as stream:
            head = stream.read(HEAD_BYTES)
        try:  # a multi-byte character cut at the end of the head is not an error; at the end of the file it is
            return codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < HEAD_BYTES) or None
        except UnicodeDecodeError as exc:
            raise DataError(f"{item.path}: not UTF-8 text ({exc})") from exc
    return next((doc for doc in iter_documents(item, text_key) if doc), None)


def _jsonl(path: Path) -> Iterator[tuple[Any, str]]:
    with open(path, encoding="utf-8") as stream:
        try:
            for lineno, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
                yield record, f"{path}:{lineno}"
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text ({exc})") from exc


def _json(path: Path) -> Iterator[tuple[Any, str]]:
    """A .json file: one JSON array of records (parsed whole)."""
    try:
        with open(path, encoding="utf-8") as stream:
            records = json.load(stream)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc})") from exc
    except json.JSONDecodeError as exc:
        hint = ""
        if exc.msg == "Extra data":  # an object a line: JSON Lines under the .json extension
            hint = ": one record a line is JSON Lines (rename it .jsonl, or set data.format=jsonl)"
        raise DataError(f"{path}: not valid JSON ({exc}){hint}") from exc
    if not isinstance(records, list):
        raise DataError(f"{path}: a .json file holds a JSON array of records, got a JSON {type(records).__name__}")
    for i, record in enumerate(records):
        yield record, f"{path}: record {i}"


def _present(value: Any) -> Any:
    """A table row's value without its null fields (a column or struct field the record does not have)."""
    if isinstance(value, dict):
        return {k: _present(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_present(v) for v in value]
    return value


def _column(item: Input, text_key: str) -> Iterator[str]:
    """The non-null cells of column ``text_key`` of a Parquet or Arrow input."""
    read = _parquet_batches if item.format == "parquet" else _arrow_batches
    for batch in read(item.path, text_key):
        for text in batch.column(batch.schema.get_field_index(text_key)).to_pylist():
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(f"{item.path}: column {text_key!r} holds {type(text).__name__}, not text")
            yield text


def _parquet_batches(path: Path, column: str | None) -> Iterator[Any]:
    """A Parquet file's record batches: of ``column`` alone (refused, naming the columns, where there is none), or
    of every column (``None``)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DataError(f"reading {path} needs pyarrow: install pyarrow (pip install pyarrow)") from exc
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own error types
        raise DataError(f"cannot read parquet file {path}: {exc}") from exc
    if column is not None and column not in table.schema_arrow.names:
        raise DataError(
            f"{path}: no column {column!r} (columns: {', '.join(table.schema_arrow.names)}; data.text_key / --text-key)"
        )
    yield from table.iter_batches(columns=None if column is None else [column], batch_size=1024)


def _arrow_batches(path: Path, column: str | None) -> Iterator[Any]:
    """An Arrow IPC file's record batches, memory-mapped and read one at a time (what Hugging Face ``datasets``
    writes: ``save_to_disk`` folders hold ``data-NNNNN-of-NNNNN.arrow`` stream files, which a folder input reads in
    order); refused, naming the columns, where ``column`` (unless ``None``) is none of them."""
    try:
        import pyarrow as pa
    except ImportError as exc:
        raise DataError(f"reading {path} needs pyarrow: pip install 'primus-core[data]' (or pyarrow)") from exc
    try:
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(path)))
            batches = iter(reader)
            schema = reader.schema
        except pa.ArrowInvalid:  # the random-access file format
            file = pa.ipc.open_file(pa.memory_map(str(path)))
            batches = (file.get_batch(i) for i in range(file.num_record_batches))
            schema = file.schema
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own error types
        raise DataError(f"cannot read Arrow file {path}: {exc}") from exc
    if column is not None and column not in schema.names:
        raise DataError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)}; data.text_key)")
    yield from batches
