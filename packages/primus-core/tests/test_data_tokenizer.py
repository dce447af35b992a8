"""The bundled corpus and tokenizer, and loading tokenizers from files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from primus.core.data import DataError, corpus, eos_id, load_tokenizer, tokenizer


@pytest.fixture(autouse=True)
def shared_cache(tmp_path_factory, monkeypatch) -> Path:
    root = tmp_path_factory.getbasetemp() / "primus-cache"
    monkeypatch.setenv("PRIMUS_CACHE", str(root))
    return root


def test_corpus_is_deterministic_and_sizeable():
    docs = corpus.documents()
    assert len(docs) > 3000
    assert 1_000_000 < sum(map(len, docs)) < 5_000_000
    assert len(set(docs)) == len(docs)
    assert all(doc == doc.strip() and doc for doc in docs)
    assert docs[0] == corpus._doc(__import__("abc"))  # first module in the fixed order, its docstring first
    assert list(corpus.MODULES) == sorted(corpus.MODULES)
    for unsafe in ("this", "antigravity", "tkinter", "turtle", "idlelib", "os", "socket"):
        assert unsafe not in corpus.MODULES


def test_corpus_does_not_depend_on_what_the_process_imported_before(monkeypatch):
    """A library that patches a stdlib function (typing_extensions, torch.package's ``inspect.getfile``) made the walk
    leave its docstring out: a run that had imported torch first built another corpus under the same cache key."""
    import inspect

    before = corpus.documents()
    original = inspect.getfile

    def getfile(obj):  # as torch.package patches it: a function of another module in inspect's dict
        return original(obj)

    monkeypatch.setattr(inspect, "getfile", getfile)
    corpus.documents.cache_clear()
    try:
        after = corpus.documents()
    finally:
        corpus.documents.cache_clear()
    assert after == before
    assert "Work out which source or compiled file an object was defined in." in after
    # what the walk gives in this process, patched
    assert "Work out which source or compiled file an object was defined in." not in corpus._walk()


def test_import_and_corpus_walk_pull_in_no_torch_and_no_side_effect_modules():
    code = (
        "import sys; import primus.core.data as d; from primus.core.data import corpus; corpus.documents();"
        "bad = [m for m in ('torch', 'this', 'antigravity', 'tkinter', 'turtle') if m in sys.modules];"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    # The CLI sub-app stays light: `primus --help` must not pay for numpy or tokenizers.
    code = "import sys; import primus.core.cli.data; print([m for m in ('numpy', 'tokenizers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_bundled_tokenizer_vocab_specials_and_round_trip(shared_cache: Path):
    tok = load_tokenizer("bundled")
    assert tok.get_vocab_size() == 2048
    assert tok.token_to_id("<|endoftext|>") == 0 == eos_id(tok)
    assert tok.token_to_id("<|pad|>") == 1
    text = 'def mean(xs):\n    """Return the arithmetic mean of xs."""  # naïve ✓\n'
    ids = tok.encode(text).ids
    assert max(ids) < 2048
    assert tok.decode(ids) == text
    english = "Return a new sorted list from the items in iterable. The default value is None."
    assert len(tok.encode(english).ids) < len(english) / 3  # merges learned from docstrings compress English
    assert (tokenizer.bundled_dir(shared_cache) / "tokenizer.json").is_file()


def test_bundled_tokenizer_is_identical_when_built_twice(tmp_path: Path, monkeypatch):
    files = []
    for name in ("a", "b"):
        monkeypatch.setenv("PRIMUS_CACHE", str(tmp_path / name))
        load_tokenizer("bundled")
        files.append(tokenizer.bundled_dir() / "tokenizer.json")
    assert files[0] != files[1]
    assert files[0].read_bytes() == files[1].read_bytes()


def test_bundled_tokenizer_cache_is_reused(monkeypatch):
    first = load_tokenizer("bundled")

    def no_training():
        raise AssertionError("retrained although the cache holds the tokenizer")

    monkeypatch.setattr(tokenizer, "train_bundled", no_training)
    assert load_tokenizer("bundled").to_str() == first.to_str()


def test_damaged_bundled_cache_is_rebuilt(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PRIMUS_CACHE", str(tmp_path))
    path = tokenizer.bundled_dir() / "tokenizer.json"
    path.parent.mkdir(parents=True)
    path.write_text("{ truncated")
    assert load_tokenizer("bundled").get_vocab_size() == 2048
    assert json.loads(path.read_text())["model"]["type"] == "BPE"


def test_concurrent_ranks_build_one_valid_tokenizer(tmp_path: Path):
    code = (
        "from primus.core.data import load_tokenizer; import hashlib;"
        "print(hashlib.sha256(load_tokenizer('bundled').to_str().encode()).hexdigest())"
    )
    env = {**os.environ, "PRIMUS_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    digests = {proc.communicate()[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert len(digests) == 1
    assert [p.name for p in (tmp_path / "tokenizers").rglob("*") if p.suffix == ".tmp"] == []


def test_load_from_folder_and_file(tmp_path: Path):
    bundled = load_tokenizer("bundled")
    bundled.save(str(tmp_path / "tokenizer.json"))
    text = "Return a new list."
    for spec in (str(tmp_path), str(tmp_path / "tokenizer.json")):
        assert load_tokenizer(spec).encode(text).ids == bundled.encode(text).ids


def test_missing_and_corrupt_tokenizers_name_the_path(tmp_path: Path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(DataError, match=str(missing)):
        load_tokenizer(str(missing))
    with pytest.raises(DataError, match=f"{tmp_path}.*no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": 42}')
    with pytest.raises(DataError, match=f"cannot read tokenizer file {bad}"):
        load_tokenizer(str(bad))
    assert issubclass(DataError, ValueError)


def test_eos_id_of_other_families():
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2}, unk_token="hi"))
    assert eos_id(tok) == 1
    with pytest.raises(DataError, match="end-of-document"):
        eos_id(Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))
