"""``primus data prepare``: text files -> Megatron .bin/.idx, read back token-exact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from primus.core.cli.data import data_app
from primus.core.config.schema import DataConfig
from primus.core.data import IndexedReader, eos_id, load_token_stream, load_tokenizer
from primus.core.data.prepare import prepare

DOCS = ["First document.\nWith two lines.", "", "Second: naïve café ✓", "def f(x):\n    return x + 1\n"]


@pytest.fixture(autouse=True)
def shared_cache(tmp_path_factory, monkeypatch) -> Path:
    root = tmp_path_factory.getbasetemp() / "primus-cache"
    monkeypatch.setenv("PRIMUS_CACHE", str(root))
    return root


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS[:3]), encoding="utf-8")
    (folder / "b.txt").write_text(DOCS[3], encoding="utf-8")
    return folder


def _cli() -> typer.Typer:
    app = typer.Typer()  # the way primus.core.cli.app mounts it

    @app.callback()
    def main() -> None:
        pass

    app.add_typer(data_app, name="data")
    return app


def test_cli_prepare_reads_back_token_exact(inputs: Path, tmp_path: Path):
    out = tmp_path / "out" / "corpus"
    result = CliRunner().invoke(
        _cli(), ["data", "prepare", str(inputs), "--tokenizer", "bundled", "--output", str(out), "--text-key", "body"]
    )
    assert result.exit_code == 0, result.output
    assert "3 documents" in result.output

    tok = load_tokenizer("bundled")
    expected = [tok.encode(d, add_special_tokens=False).ids + [eos_id(tok)] for d in DOCS if d]
    reader = IndexedReader(out)
    assert reader.dtype == np.uint16
    assert [reader[i].tolist() for i in range(len(reader))] == expected
    assert tok.decode(reader[2].tolist()) == DOCS[3]

    # A prepared dataset gives the same training stream as its text.
    from_bin = load_token_stream(DataConfig(source=str(out)), tok, 2048, 0)
    from_text = load_token_stream(DataConfig(source=str(inputs), text_key="body"), tok, 2048, 0)
    assert from_bin.tolist() == from_text.tolist() == sum(expected, [])


def test_no_append_eos(inputs: Path, tmp_path: Path):
    result = CliRunner().invoke(
        _cli(), ["data", "prepare", str(inputs / "b.txt"), "-o", str(tmp_path / "x"), "--no-append-eos"]
    )
    assert result.exit_code == 0, result.output
    tok = load_tokenizer("bundled")
    assert IndexedReader(tmp_path / "x")[0].tolist() == tok.encode(DOCS[3], add_special_tokens=False).ids


def test_megatron_and_numpy_writers_write_identical_files(inputs: Path, tmp_path: Path):
    pytest.importorskip("megatron.core")
    a = prepare([str(inputs)], output=str(tmp_path / "meg"), text_key="body", writer="megatron", progress=False)
    b = prepare([str(inputs)], output=str(tmp_path / "np"), text_key="body", writer="numpy", progress=False)
    assert (a.writer, b.writer) == ("megatron", "numpy")
    assert (a.documents, a.tokens) == (b.documents, b.tokens) == (3, a.tokens)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"meg{ext}").read_bytes() == (tmp_path / f"np{ext}").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "meg.bin", "meg.idx", "np.bin", "np.idx"]


def test_errors_exit_2_and_name_the_path(inputs: Path, tmp_path: Path):
    missing = tmp_path / "nothing.jsonl"
    result = CliRunner().invoke(_cli(), ["data", "prepare", str(missing), "-o", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert str(missing) in result.output
    result = CliRunner().invoke(_cli(), ["data", "prepare", str(inputs), "-o", str(tmp_path / "x")])
    assert result.exit_code == 2  # default text key "text" is absent
    assert f"{inputs / 'a.jsonl'}:1: no string field 'text'" in result.output
    assert not list(tmp_path.glob("x*"))  # nothing half-written is left behind
