"""Training from files: text (.jsonl) with a Hugging Face tokenizer.json, and the same documents as a
Megatron indexed dataset (.bin/.idx). Both are the same token stream, so from the same seed they must
give the same losses."""

from __future__ import annotations

import collections
import json
import os
import pathlib

import pytest
from conftest import TINY, losses, primus_train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from primus.core.data import eos_id, load_tokenizer, write_indexed

    root = tmp_path_factory.mktemp("corpus")
    docs = [m.__doc__ for m in (os, os.path, json, collections, pathlib, pytest) if m.__doc__]
    docs += [f.__doc__ for f in (sorted, map, zip, open, print, isinstance) if f.__doc__]
    with open(root / "docs.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    tok = load_tokenizer("bundled")
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    eos = eos_id(tok)
    write_indexed(root / "docs", [tok.encode(d).ids + [eos] for d in docs])
    return root


def test_jsonl_with_tokenizer_json_and_megatron_indexed_give_the_same_run(corpus, tmp_path):
    common = ("train.steps=6", "checkpoint.enabled=false")
    primus_train(
        TINY, tmp_path / "jsonl", *common, f"data.source={corpus / 'docs.jsonl'}", f"data.tokenizer={corpus / 'tok'}"
    )
    primus_train(TINY, tmp_path / "megatron", *common, f"data.source={corpus / 'docs'}", "data.format=megatron")
    text, indexed = losses(tmp_path / "jsonl"), losses(tmp_path / "megatron")
    assert len(text) == 6 and text[-1] < text[0] - 0.15, text
    assert indexed == pytest.approx(text, rel=1e-6)
