"""Megatron .bin/.idx: our numpy reader and writer against megatron-core's own IndexedDataset."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

from primus.core.data import DataError, IndexedReader, write_indexed
from primus.core.data.indexed import IndexedWriter, optimal_dtype


def _documents(seed: int = 0, count: int = 40, vocab: int = 2048) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, size=int(rng.integers(1, 300))) for _ in range(count)]
    docs[5] = np.zeros(0, dtype=np.int64)  # an empty document is legal
    return docs


def _megatron():
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_write_then_read_is_token_exact(tmp_path: Path, dtype):
    docs = _documents()
    count, tokens = write_indexed(tmp_path / "ds", docs, dtype=dtype)
    assert (count, tokens) == (len(docs), sum(len(d) for d in docs))
    reader = IndexedReader(tmp_path / "ds")
    assert reader.dtype == np.dtype(dtype)
    assert len(reader) == reader.num_documents == len(docs)
    assert reader.document_indices.tolist() == list(range(len(docs) + 1))
    for i, doc in enumerate(docs):
        assert reader[i].tolist() == doc.tolist() == reader.document(i).tolist()
    assert reader.tokens.tolist() == np.concatenate(docs).tolist()
    assert (tmp_path / "ds.bin").stat().st_size == tokens * np.dtype(dtype).itemsize


def test_header_layout(tmp_path: Path):
    write_indexed(tmp_path / "ds", [[1, 2, 3], [4]], dtype=np.uint16)
    raw = (tmp_path / "ds.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 8, 2, 3)  # version 1, uint16 code 8, 2 sequences, 3 doc indices
    assert np.frombuffer(raw[34:42], np.int32).tolist() == [3, 1]
    assert np.frombuffer(raw[42:58], np.int64).tolist() == [0, 6]  # byte offsets: 3 uint16 tokens
    assert np.frombuffer(raw[58:82], np.int64).tolist() == [0, 1, 2]
    assert len(raw) == 82
    assert optimal_dtype(2048) is np.uint16 and optimal_dtype(128256) is np.int32


def test_ours_read_by_megatron(tmp_path: Path):
    indexed_dataset = _megatron()
    docs = _documents(seed=1)
    write_indexed(tmp_path / "ds", docs, dtype=np.uint16)
    theirs = indexed_dataset.IndexedDataset(str(tmp_path / "ds"))
    assert len(theirs) == len(docs)
    assert theirs.index.dtype == np.uint16
    assert theirs.document_indices.tolist() == list(range(len(docs) + 1))
    for i, doc in enumerate(docs):
        assert theirs[i].tolist() == doc.tolist()
    assert [s.tolist() for s in theirs[2:7]] == [d.tolist() for d in docs[2:7]]


def test_megatron_read_by_ours_including_multi_sequence_documents(tmp_path: Path):
    indexed_dataset = _megatron()
    docs = _documents(seed=2)
    prefix = str(tmp_path / "ds")
    builder = indexed_dataset.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in docs[:20]:
        builder.add_document(doc, [len(doc)])
    whole = np.concatenate(docs[20:])  # one document made of 20 sequences (Megatron's --split-sentences layout)
    builder.add_document(whole, [len(doc) for doc in docs[20:]])
    builder.finalize(prefix + ".idx")

    ours = IndexedReader(prefix)
    assert len(ours) == len(docs) and ours.num_documents == 21
    assert ours.dtype == np.int32
    for i, doc in enumerate(docs):
        assert ours[i].tolist() == doc.tolist()
    assert ours.document(20).tolist() == whole.tolist()

    # And the same calls on our writer give the same bytes.
    with IndexedWriter(tmp_path / "mine", np.int32) as writer:
        for doc in docs[:20]:
            writer.add_document(doc, [len(doc)])
        writer.add_document(whole, [len(doc) for doc in docs[20:]])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"mine{ext}").read_bytes() == Path(prefix + ext).read_bytes()


def test_bad_files_name_the_path(tmp_path: Path):
    with pytest.raises(DataError, match=f"missing {tmp_path / 'none.idx'}"):
        IndexedReader(tmp_path / "none")
    write_indexed(tmp_path / "ds", [[1, 2, 3], [4, 5]])
    idx = tmp_path / "ds.idx"
    good = idx.read_bytes()
    idx.write_bytes(b"NOTANIDX!" + good[9:])
    with pytest.raises(DataError, match=f"{idx}: not a Megatron MMIDIDX index"):
        IndexedReader(tmp_path / "ds")
    idx.write_bytes(good[:40])
    with pytest.raises(DataError, match=f"{idx}: truncated"):
        IndexedReader(tmp_path / "ds")
    idx.write_bytes(good)
    (tmp_path / "ds.bin").write_bytes((tmp_path / "ds.bin").read_bytes()[:8])
    with pytest.raises(DataError, match=f"{tmp_path / 'ds.bin'}: truncated"):
        IndexedReader(tmp_path / "ds")


def test_empty_dataset(tmp_path: Path):
    assert write_indexed(tmp_path / "empty", []) == (0, 0)
    reader = IndexedReader(tmp_path / "empty")
    assert len(reader) == 0 and reader.num_documents == 0 and reader.tokens.size == 0
