"""Megatron's MMIDIDX indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``), read and written with numpy only.

Byte-compatible with ``megatron.core.datasets.indexed_dataset`` (megatron-core 0.16.1). The ``.bin`` file is
the raw tokens of every sequence back to back. The ``.idx`` file is, little-endian::

    b"MMIDIDX\\x00\\x00"            9-byte magic
    <Q version = 1
    <B dtype code                   1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    <Q sequence count S
    <Q document count D             = number of documents + 1
    int32[S] sequence lengths       in tokens
    int64[S] sequence pointers      byte offset of each sequence in .bin
    int64[D] document indices       sequence index where each document starts; first 0, last S
    int8[S]  sequence modes         multimodal datasets only

Primus writes one sequence per document (what Megatron's ``preprocess_data.py`` writes without
``--split-sentences``), so ``document_indices == [0, 1, ..., S]``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import numpy as np

from primus.core.data.errors import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEAD = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count: 34

DTYPES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}


def optimal_dtype(vocab_size: int) -> type[np.number]:
    """The token dtype Megatron's preprocessing picks for a vocabulary: uint16 below 65500, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def is_prefix(path: str | Path) -> bool:
    """Whether ``<path>.bin`` and ``<path>.idx`` both exist."""
    return idx_path(path).is_file() and bin_path(path).is_file()


class IndexedReader:
    """A memory-mapped view of one Megatron indexed dataset.

    ``len(reader)`` is the number of sequences and ``reader[i]`` the tokens of sequence ``i``;
    ``reader.document(j)`` gives document ``j`` and ``reader.tokens`` the whole ``.bin``.
    """

    def __init__(self, prefix: str | Path, multimodal: bool = False) -> None:
        self.prefix = str(prefix)
        idx, data = idx_path(prefix), bin_path(prefix)
        for path in (idx, data):
            if not path.is_file():
                raise DataError(f"Megatron dataset {self.prefix}: missing {path}")
        size = idx.stat().st_size
        with open(idx, "rb") as stream:
            head = stream.read(_HEAD)
        if len(head) < _HEAD or head[: len(INDEX_HEADER)] != INDEX_HEADER:
            raise DataError(f"{idx}: not a Megatron MMIDIDX index (bad header)")
        version, code, count, doc_count = struct.unpack("<QBQQ", head[len(INDEX_HEADER) :])
        if version != _VERSION:
            raise DataError(f"{idx}: index version {version}, only version {_VERSION} is known")
        if code not in DTYPES:
            raise DataError(f"{idx}: unknown dtype code {code}")
        need = _HEAD + count * (4 + 8) + doc_count * 8 + (count if multimodal else 0)
        if size < need:
            raise DataError(f"{idx}: truncated ({size} bytes, the header promises {need})")
        self.dtype = np.dtype(DTYPES[code])
        offset = _HEAD
        self.sequence_lengths = self._map(idx, np.int32, offset, count)
        offset += count * 4
        self.sequence_pointers = self._map(idx, np.int64, offset, count)
        offset += count * 8
        self.document_indices = self._map(idx, np.int64, offset, doc_count)
        offset += doc_count * 8
        self.sequence_modes = self._map(idx, np.int8, offset, count) if multimodal else None

        nbytes = data.stat().st_size
        if count and int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize > nbytes:
            raise DataError(f"{data}: truncated ({nbytes} bytes, shorter than {idx} says)")
        if nbytes % self.dtype.itemsize:
            raise DataError(f"{data}: {nbytes} bytes is not a whole number of {self.dtype} tokens")
        self.tokens = self._map(data, self.dtype, 0, nbytes // self.dtype.itemsize)

    @staticmethod
    def _map(path: Path, dtype: type[np.number] | np.dtype, offset: int, count: int) -> np.ndarray:
        if count == 0:  # numpy cannot map zero bytes
            return np.empty(0, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sequence_lengths[index])]

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    def document(self, index: int) -> np.ndarray:
        """All tokens of document ``index`` (its sequences are contiguous in ``.bin``)."""
        first, last = int(self.document_indices[index]), int(self.document_indices[index + 1])
        if first == last:
            return self.tokens[:0]
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sequence_lengths[first:last].sum())]


class IndexedWriter:
    """Streams documents into ``<prefix>.bin`` and writes ``<prefix>.idx`` on :meth:`finalize`.

    Same calls and same bytes as Megatron's ``IndexedDatasetBuilder.add_document`` / ``finalize``.
    """

    def __init__(self, prefix: str | Path, dtype: type[np.number] | np.dtype = np.int32) -> None:
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise DataError(f"{self.dtype} is not a Megatron token dtype ({', '.join(map(str, CODES))})")
        bin_path(prefix).parent.mkdir(parents=True, exist_ok=True)
        self._data = open(bin_path(prefix), "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_document(self, tokens: Iterable[int] | np.ndarray, lengths: list[int] | None = None) -> None:
        """Append one document; ``lengths`` splits it into sequences (default: one sequence)."""
        array = np.asarray(tokens, dtype=self.dtype)
        self._data.write(array.tobytes(order="C"))
        self.sequence_lengths.extend([array.size] if lengths is None else lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self) -> None:
        self._data.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path(self.prefix), "wb") as stream:
            stream.write(INDEX_HEADER)
            stream.write(struct.pack("<QB", _VERSION, CODES[self.dtype]))
            stream.write(struct.pack("<QQ", len(lengths), len(self.document_indices)))
            stream.write(lengths.tobytes(order="C"))
            stream.write(pointers.tobytes(order="C"))
            stream.write(np.asarray(self.document_indices, dtype=np.int64).tobytes(order="C"))

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self._data.close()


def write_indexed(
    prefix: str | Path, documents: Iterable[Iterable[int] | np.ndarray], dtype: type[np.number] | np.dtype = np.int32
) -> tuple[int, int]:
    """Write ``documents`` (token id sequences) as ``<prefix>.bin/.idx``; returns (documents, tokens)."""
    with IndexedWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    return len(writer.sequence_lengths), int(sum(writer.sequence_lengths))
