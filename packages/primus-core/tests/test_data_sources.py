"""load_token_stream over every source kind, its cache, and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from primus.core.config.schema import DataConfig
from primus.core.data import DataError, corpus, eos_id, load_token_stream, load_tokenizer, sources, write_indexed

DOCS = ["The quick brown fox.", "Return the sum of a and b.\n\nSecond paragraph.", "naïve café ✓", "x"]


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch) -> Path:
    # The bundled tokenizer is shared by the session; token streams go to a fresh cache per test.
    shared = tmp_path_factory.getbasetemp() / "primus-cache"
    monkeypatch.setenv("PRIMUS_CACHE", str(shared))
    tok = load_tokenizer("bundled")
    fresh = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("PRIMUS_CACHE", str(fresh))
    # Streams that load data.tokenizer themselves get the session's bundled tokenizer.
    monkeypatch.setattr(sources, "load_tokenizer", lambda spec: tok if spec == "bundled" else load_tokenizer(spec))
    return fresh


@pytest.fixture
def tok():
    return sources.load_tokenizer("bundled")


def _expected(tok, docs) -> list[int]:
    out: list[int] = []
    for doc in docs:
        ids = tok.encode(doc, add_special_tokens=False).ids
        if ids:
            out += ids + [eos_id(tok)]
    return out


def _jsonl(path: Path, docs, key="text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def test_mock_is_seeded_and_in_range():
    a = load_token_stream(DataConfig(source="mock"), None, 1000, seed=3)
    b = load_token_stream(DataConfig(source="mock"), None, 1000, seed=3)
    c = load_token_stream(DataConfig(source="mock"), None, 1000, seed=4)
    assert a.dtype == np.int32 and a.shape == (1 << 20,)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.min() == 0 and a.max() == 999


def test_bundled_stream_is_the_corpus_with_eos(tok, cache: Path):
    stream = load_token_stream(DataConfig(), tok, 2048, seed=0)
    docs = corpus.documents()
    assert stream.dtype == np.int32 and stream.ndim == 1
    assert int((stream == eos_id(tok)).sum()) == len(docs)
    head = _expected(tok, docs[:3])
    assert stream[: len(head)].tolist() == head
    assert stream[-1] == eos_id(tok)
    assert len(list((cache / "tokens").glob("*.npy"))) == 1


def test_cache_is_reused_and_invalidated(tmp_path: Path, tok, monkeypatch):
    data = _jsonl(tmp_path / "a.jsonl", DOCS)
    cfg = DataConfig(source=str(data))
    first = load_token_stream(cfg, tok, 2048, 0)
    assert first.tolist() == _expected(tok, DOCS)

    real_build = sources._build
    monkeypatch.setattr(sources, "_build", lambda *a: pytest.fail("re-tokenized although cached"))
    assert load_token_stream(cfg, tok, 2048, 0).tolist() == first.tolist()

    monkeypatch.setattr(sources, "_build", real_build)
    _jsonl(data, DOCS + ["one more document"])
    os.utime(data, ns=(1, 1))  # a different mtime even on coarse-clock filesystems
    assert load_token_stream(cfg, tok, 2048, 0).tolist() == _expected(tok, DOCS + ["one more document"])


def test_txt_is_one_document_per_file_and_folders_are_sorted(tmp_path: Path, tok):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text(DOCS[1], encoding="utf-8")
    (tmp_path / "sub" / "c.txt").write_text(DOCS[2], encoding="utf-8")
    _jsonl(tmp_path / "a.jsonl", DOCS[:1])
    (tmp_path / "notes.md").write_text("ignored: not a supported extension")
    stream = load_token_stream(DataConfig(source=str(tmp_path)), tok, 2048, 0)
    assert stream.tolist() == _expected(tok, [DOCS[0], DOCS[1], DOCS[2]])  # a.jsonl, b.txt, sub/c.txt


def test_glob_paths_and_explicit_format(tmp_path: Path, tok):
    _jsonl(tmp_path / "x1.jsonl", DOCS[:2], key="content")
    _jsonl(tmp_path / "x2.jsonl", DOCS[2:], key="content")
    (tmp_path / "extra.data").write_text(DOCS[0])
    cfg = DataConfig(source=str(tmp_path / "x*.jsonl"), paths=[], text_key="content")
    assert load_token_stream(cfg, tok, 2048, 0).tolist() == _expected(tok, DOCS)
    cfg = DataConfig(source=str(tmp_path / "extra.data"), format="txt")
    assert load_token_stream(cfg, tok, 2048, 0).tolist() == _expected(tok, DOCS[:1])
    cfg = DataConfig(source="bundled", paths=[str(tmp_path / "extra.data")], format="txt")
    stream = load_token_stream(cfg, tok, 2048, 0)
    tail = _expected(tok, DOCS[:1])
    assert stream[-len(tail) :].tolist() == tail and len(stream) > 100_000


def test_parquet(tmp_path: Path, tok):
    import pyarrow as pa  # primus-core[data]
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS + [None], "n": list(range(len(DOCS) + 1))}), tmp_path / "d.parquet")
    assert load_token_stream(DataConfig(source=str(tmp_path / "d.parquet")), tok, 2048, 0).tolist() == _expected(
        tok, DOCS
    )
    with pytest.raises(DataError, match=f"{tmp_path / 'd.parquet'}: no column 'body'"):
        load_token_stream(DataConfig(source=str(tmp_path / "d.parquet"), text_key="body"), tok, 2048, 0)


def test_hugging_face_datasets_folder(tmp_path: Path, tok):
    """A ``datasets`` folder written by ``save_to_disk`` (two Arrow shards) reads as the same documents, in order,
    memory-mapped; a DatasetDict folder is refused naming a split to use; a missing column is named."""
    import datasets

    ds = datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))})
    ds.save_to_disk(str(tmp_path / "hf"), num_shards=2)
    assert len(list((tmp_path / "hf").glob("*.arrow"))) == 2
    got = load_token_stream(DataConfig(source=str(tmp_path / "hf")), tok, 2048, 0)
    assert got.tolist() == _expected(tok, DOCS)
    with pytest.raises(DataError, match="no column 'body'"):
        load_token_stream(DataConfig(source=str(tmp_path / "hf"), text_key="body"), tok, 2048, 0)
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict \(splits train, test\): name one split's folder"):
        load_token_stream(DataConfig(source=str(tmp_path / "dd")), tok, 2048, 0)
    assert load_token_stream(DataConfig(source=str(tmp_path / "dd" / "train")), tok, 2048, 0).tolist() == got.tolist()


def test_parquet_without_pyarrow_says_install_pyarrow(tmp_path: Path, tok, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=f"reading {tmp_path / 'd.parquet'} needs pyarrow: install pyarrow"):
        load_token_stream(DataConfig(source=str(tmp_path / "d.parquet")), tok, 2048, 0)


def test_megatron_prefix_is_taken_as_is(tmp_path: Path):
    docs = [[5, 6, 7, 0], [8, 9, 0]]
    write_indexed(tmp_path / "ds", docs, dtype=np.uint16)
    for spec in (tmp_path / "ds", tmp_path / "ds.bin", tmp_path / "ds.idx"):
        stream = load_token_stream(DataConfig(source=str(spec)), None, 2048, 0)  # no tokenizer needed
        assert stream.dtype == np.int32 and stream.tolist() == [5, 6, 7, 0, 8, 9, 0]
    stream = load_token_stream(DataConfig(source=str(tmp_path)), None, 2048, 0)
    assert stream.tolist() == [5, 6, 7, 0, 8, 9, 0]
    with pytest.raises(DataError, match="token id 9 >= model.vocab_size 9"):
        load_token_stream(DataConfig(source=str(tmp_path / "ds")), None, 9, 0)


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path: Path, tok):
    with pytest.raises(DataError, match="has 2048 tokens but model.vocab_size is 1000"):
        load_token_stream(DataConfig(source=str(_jsonl(tmp_path / "a.jsonl", DOCS))), tok, 1000, 0)


def test_bad_inputs_name_the_path(tmp_path: Path, tok):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DataError, match=f"data.source: no such file, folder or Megatron prefix: {missing}"):
        load_token_stream(DataConfig(source=str(missing)), tok, 2048, 0)
    with pytest.raises(DataError, match=r"data.paths\[0\]: no files match"):
        load_token_stream(DataConfig(source="bundled", paths=[str(tmp_path / "*.jsonl")]), tok, 2048, 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=f"{bad}:2: no string field 'text'"):
        load_token_stream(DataConfig(source=str(bad)), tok, 2048, 0)
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(DataError, match=f"{bad}:2: not valid JSON"):
        load_token_stream(DataConfig(source=str(bad)), tok, 2048, 0)
    odd = tmp_path / "data.csv"
    odd.write_text("a,b")
    with pytest.raises(DataError, match=f"cannot tell the format of {odd}"):
        load_token_stream(DataConfig(source=str(odd)), tok, 2048, 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=f"folder {tmp_path / 'empty'} holds no supported files"):
        load_token_stream(DataConfig(source=str(tmp_path / "empty")), tok, 2048, 0)


def test_concurrent_ranks_share_one_cache_entry(tmp_path: Path, cache: Path):
    data = _jsonl(tmp_path / "a.jsonl", DOCS * 200)
    code = (
        "import hashlib, sys; from primus.core.config.schema import DataConfig;"
        "from primus.core.data import load_token_stream;"
        f"s = load_token_stream(DataConfig(source={str(data)!r}), None, 2048, 0);"
        "print(hashlib.sha256(s.tobytes()).hexdigest(), len(s))"
    )
    env = {**os.environ, "PRIMUS_CACHE": str(cache)}  # a fresh cache: the ranks also share one tokenizer build
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    outputs = {proc.communicate()[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert len(outputs) == 1
    assert len(list((cache / "tokens").glob("*.npy"))) == 1
    assert not list((cache / "tokens").glob("*.tmp"))
