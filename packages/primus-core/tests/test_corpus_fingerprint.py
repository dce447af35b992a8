"""The bundled corpus is the same text whatever the process imported first, and its cache keys carry its fingerprint.

Before: a cache built by a 2-rank run (torch imported first: it replaces inspect.getsourcefile and two typing
helpers) held 5,360 documents, one built by a 1-rank run 5,363, under one cache key, so the same recipe had another
first loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from primus.core.data import corpus

REPORT = (
    "from primus.core.data import corpus; import json; d = corpus.documents();"
    "print(json.dumps([len(d), corpus.fingerprint(d), corpus.corpus_id()]))"
)


def test_the_corpus_does_not_depend_on_what_was_imported_first(tmp_path):
    """Count, fingerprint and id of the corpus that fresh processes build into empty caches: plain, after importing
    torch, and with docstrings stripped in the caller (-OO); run side by side."""
    runs = {"plain": [], "torch": [], "oo": ["-OO"]}
    procs = {
        name: subprocess.Popen(
            [sys.executable, *flags, "-c", ("import torch;" if name == "torch" else "") + REPORT],
            env={**os.environ, "PRIMUS_CACHE": str(tmp_path / name)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, flags in runs.items()
    }
    built = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        built[name] = json.loads(out)
    assert built["torch"] == built["plain"] and built["oo"] == built["plain"]
    assert built["plain"][0] > 5000 and len(built["plain"][1]) == 64


def test_the_cache_keys_carry_the_contents_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIMUS_CACHE", str(tmp_path))
    docs = corpus.documents()
    assert corpus.fingerprint(docs) != corpus.fingerprint(docs[:-1])
    before = corpus.corpus_id()
    corpus._load.cache_clear()
    monkeypatch.setattr(corpus, "_walk_fresh", lambda: list(docs[:-1]))  # another interpreter's stdlib, say
    monkeypatch.setattr(corpus, "_cache_file", lambda: tmp_path / "other.json")
    try:
        assert corpus.documents() == docs[:-1]
        assert corpus.corpus_id() != before
    finally:
        corpus._load.cache_clear()


def test_a_damaged_cache_entry_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIMUS_CACHE", str(tmp_path))
    corpus._load.cache_clear()
    try:
        docs = corpus.documents()
        path = corpus._cache_file()
        kept = json.loads(path.read_text())
        kept["documents"][0] = "tampered"
        path.write_text(json.dumps(kept))
        corpus._load.cache_clear()
        assert corpus.documents() == docs
    finally:
        corpus._load.cache_clear()


def test_the_walk_in_this_process_would_have_changed(monkeypatch):
    """Why the walk runs in a fresh interpreter: a member replaced by another package (what torch does) drops its
    docstring from an in-process walk; documents() is untouched."""
    docs = corpus.documents()
    import inspect

    original = inspect.getsourcefile
    monkeypatch.setattr(inspect, "getsourcefile", lambda *a, **k: original(*a, **k))
    assert corpus._doc(original) in docs and corpus._doc(original) not in corpus.walk()
    assert corpus.documents() == docs
