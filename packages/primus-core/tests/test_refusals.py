"""A user's mistake is refused before anything is written: exit 2, one ``error:`` naming the key or file, no
traceback, and no run folder afterwards. One test per class of mistake (the examples parametrized), through the
cheapest path: ``primus config validate`` or ``primus train`` in process, on core's fake backend (conftest), so
each refusal must happen before a backend is imported. ``--nproc-per-node 2`` is refused before the ranks start."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from primus.core.cli import app as cli
from primus.core.config.loader import load_layers
from primus.core.config.presets import resolver
from primus.core.config.validate import validate_config
from primus.core.data import write_indexed
from primus.core.launch.run_checks import fp8_warning
from primus.core.run import checkpoints
from primus.core.run.checkpoints import has_complete_checkpoint
from primus.core.run.rundir import RunFolder


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    # the bundled tokenizer is built once per session (as in test_data_sources)
    monkeypatch.setenv("PRIMUS_CACHE", str(tmp_path_factory.getbasetemp() / "primus-cache"))


def _invoke(*argv: str):
    return CliRunner().invoke(cli.app, list(argv))


def _assert_refused(res, out: Path | None, fragments: list[str]) -> None:
    text = res.output
    assert res.exit_code == 2, f"exit {res.exit_code}: {res.exception!r}\n{text[-3000:]}"
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in text, text
    assert any(line.startswith(("error:", "Usage:")) for line in text.splitlines()), text
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in:\n{text}"
    if out is not None:
        assert not out.exists(), f"{out} was written: {sorted(p.name for p in out.iterdir())}"


def _train(out: Path, *overrides: str, nproc: int = 1):
    return _invoke(
        "train",
        "tiny-llama",
        "backend.name=fake",
        "train.steps=2",
        "train.schedule.warmup_steps=0",
        f"logging.output_dir={out}",
        *overrides,
        *(["--nproc-per-node", str(nproc)] if nproc > 1 else []),
    )


# ------------------------------------------------------------------------------------------------ folders


@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize("case", ["a-file", "under-a-file", "not-writable", "checkpoint-dir-a-file"])
def test_an_unusable_run_folder_is_refused_before_anything_is_written(
    tmp_path, cli_registry, monkeypatch, case, command
):
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    out, key, extra = tmp_path / "run", "logging.output_dir", []
    if case == "a-file":
        out = afile
    elif case == "under-a-file":
        out = afile / "run"
    elif case == "not-writable":
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        out = locked / "run"
        if os.geteuid() == 0:  # root may write anywhere: make this folder read-only in the check's eyes
            real = os.access
            monkeypatch.setattr("primus.core.config.validate.os.access", lambda p, m: real(p, m) and Path(p) != locked)
    else:
        key, extra = "checkpoint.dir", [f"checkpoint.dir={afile}"]
    if command == "validate":
        res = _invoke("config", "validate", "tiny-llama", "backend.name=fake", f"logging.output_dir={out}", *extra)
    else:
        res = _train(out, *extra)
    _assert_refused(res, None if out == afile else out, [key, str(afile if "file" in case else out)])
    assert afile.read_text() == "keep me\n"


# ------------------------------------------------------------------------------------------------ config file


def test_a_config_file_that_is_not_utf8_is_refused_naming_it(tmp_path, cli_registry):
    exp = tmp_path / "exp.yaml"
    exp.write_bytes("extends: [tiny-llama]\ndescription: caf\xe9 au lait\n".encode("latin-1"))
    out = tmp_path / "run"
    for res in (_invoke("config", "validate", str(exp)), _invoke("train", str(exp), f"logging.output_dir={out}")):
        _assert_refused(res, out, [str(exp), "not UTF-8"])


# ------------------------------------------------------------------------------------------------ types, counts


@pytest.mark.parametrize(
    "override",
    [
        "train.steps=true",
        "model.head_dim=true",
        "parallel.tp=false",
        "train.optimizer.lr=true",
        "train.grad_clip=false",
    ],
)
def test_true_or_false_is_never_taken_for_a_number(tmp_path, cli_registry, override):
    out = tmp_path / "run"
    key = override.split("=")[0]
    _assert_refused(_train(out, override), out, [key, "valid"])
    _assert_refused(_invoke("config", "validate", "tiny-llama", "backend.name=fake", override), None, [key])


def test_numbers_written_as_numbers_still_validate(registry):
    layers = load_layers(
        "tiny-llama", ["train.steps=7", "train.optimizer.lr=1", "train.grad_clip=0"], resolve_preset=resolver(registry)
    )
    cfg = validate_config(layers.data)
    assert cfg.train.steps == 7 and cfg.train.optimizer.lr == 1.0 and cfg.train.grad_clip == 0.0


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "tiny-llama", "--nproc-per-node", "0"],
        ["train", "tiny-llama", "--nnodes", "0"],
        ["config", "validate", "tiny-llama", "--world-size", "0"],
    ],
    ids=["nproc-per-node", "nnodes", "world-size"],
)
def test_fewer_than_one_process_is_refused_with_the_range(tmp_path, cli_registry, argv):
    out = tmp_path / "run"
    _assert_refused(_invoke(*argv, "backend.name=fake", f"logging.output_dir={out}"), out, [argv[-2], "1"])


def test_a_layout_an_engine_would_assert_on_is_refused_by_the_config(tmp_path, cli_registry):
    # sequence parallel with a seq_len tp does not divide: an assertion deep in torchtitan, on every rank
    out = tmp_path / "run"
    sp = ["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=33"]
    _assert_refused(_train(out, *sp, nproc=2), out, ["train.seq_len", "parallel.tp (2)", "a multiple of 2"])
    _assert_refused(
        _invoke("config", "validate", "tiny-llama", "backend.name=fake", *sp, "--world-size", "2"), None, []
    )


# ------------------------------------------------------------------------------------------------ data


def _data_cases(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    (tmp / "good.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    (tmp / "nokey.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    (tmp / "badline.jsonl").write_text("{oops\n" + json.dumps({"text": "ok"}) + "\n")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp / "data.csv").write_text("a,b\n")
    (tmp / "emptydir").mkdir()
    (tmp / "broken_tok").mkdir()
    (tmp / "broken_tok" / "tokenizer.json").write_text("{ not json")
    (tmp / "only.bin").write_bytes(b"\x00" * 64)
    (tmp / "bad.bin").write_bytes(b"\x00" * 64)
    (tmp / "bad.idx").write_bytes(b"NOTMMIDIDX" + b"\x00" * 30)
    write_indexed(tmp / "wide", [np.array([1, 5000, 2])], dtype=np.int32)
    good = f"data.source={tmp / 'good.jsonl'}"
    return {
        "missing-file": ([f"data.source={tmp / 'nope.jsonl'}"], ["data.source", "nope.jsonl"]),
        "empty-jsonl": ([f"data.source={tmp / 'empty.jsonl'}"], ["empty.jsonl", "no documents"]),
        "bad-json-line": ([f"data.source={tmp / 'badline.jsonl'}"], ["badline.jsonl:1", "not valid JSON"]),
        "missing-text-key": ([f"data.source={tmp / 'nokey.jsonl'}"], ["nokey.jsonl:1", "'text'"]),
        "not-utf8-txt": ([f"data.source={tmp / 'latin.txt'}"], ["latin.txt", "not UTF-8"]),
        "unknown-extension": ([f"data.source={tmp / 'data.csv'}"], ["data.source", "data.csv"]),
        "empty-folder": ([f"data.source={tmp / 'emptydir'}"], ["data.source", "emptydir"]),
        "glob-matching-nothing": ([f"data.source={tmp / 'zz*.jsonl'}"], ["data.source", "zz*.jsonl"]),
        "bad-extra-path": ([good, f"data.paths=[{tmp / 'nope.txt'}]"], ["data.paths[0]", "nope.txt"]),
        "missing-tokenizer": ([good, f"data.tokenizer={tmp / 'no_tok'}"], ["no_tok"]),
        "corrupt-tokenizer": ([good, f"data.tokenizer={tmp / 'broken_tok'}"], ["broken_tok"]),
        "tokenizer-above-vocab": (["model.vocab_size=100"], ["model.vocab_size", "100"]),
        "bin-without-idx": ([f"data.source={tmp / 'only.bin'}"], ["only.bin"]),
        "corrupt-idx": ([f"data.source={tmp / 'bad.bin'}"], ["bad.idx"]),
        "tokens-above-vocab": ([f"data.source={tmp / 'wide'}"], ["token id 5000", "model.vocab_size 2048"]),
    }


DATA_CASES = [  # _data_cases' keys, in its order
    "missing-file",
    "empty-jsonl",
    "bad-json-line",
    "missing-text-key",
    "not-utf8-txt",
    "unknown-extension",
    "empty-folder",
    "glob-matching-nothing",
    "bad-extra-path",
    "missing-tokenizer",
    "corrupt-tokenizer",
    "tokenizer-above-vocab",
    "bin-without-idx",
    "corrupt-idx",
    "tokens-above-vocab",
]


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("case", DATA_CASES)
def test_bad_data_is_refused_before_the_run_folder_exists(tmp_path, cli_registry, case, nproc):
    cases = _data_cases(tmp_path)
    assert list(cases) == DATA_CASES
    overrides, fragments = cases[case]
    out = tmp_path / "run"
    _assert_refused(_train(out, *overrides, nproc=nproc), out, fragments)


# ------------------------------------------------------------------------------------------------ said aloud


def test_resume_with_nothing_to_resume_is_said_before_training(tmp_path, cli_registry):
    out = tmp_path / "run"
    # the run is refused afterwards (bad data), so the warning is seen without training
    res = _invoke(*_train_argv(out, f"data.source={tmp_path / 'nope.jsonl'}"), "--resume")
    _assert_refused(res, out, ["nope.jsonl"])
    assert "warning: --resume:" in res.output and str(out / "checkpoints") in res.output, res.output
    assert res.output.index("warning: --resume") < res.output.index("error:")


def _train_argv(out: Path, *overrides: str) -> list[str]:
    return ["train", "tiny-llama", "backend.name=fake", f"logging.output_dir={out}", *overrides]


def test_resume_warning_knows_a_complete_checkpoint(tmp_path, registry):
    cfg = validate_config(load_layers("tiny-llama", [f"logging.output_dir={tmp_path}"], resolver(registry)).data)
    root = tmp_path / "checkpoints"
    assert "does not exist" in RunFolder(cfg).resume_warning()
    (root / "step_00000004").mkdir(parents=True)  # an incomplete save: no manifest
    (root / "step_00000006.tmp").mkdir()
    (root / "step_00000006.tmp" / checkpoints.MANIFEST).write_text(json.dumps({"step": 6}))
    assert "holds no complete checkpoint" in RunFolder(cfg).resume_warning() and not has_complete_checkpoint(root)
    (root / "step_00000004" / checkpoints.MANIFEST).write_text(json.dumps({"step": 4}))
    assert RunFolder(cfg).resume_warning() is None
    other = tmp_path / "other"  # a backend that runs its own loop, under its own folder names
    (other / "step-3").mkdir(parents=True)
    (other / "step-3" / checkpoints.MANIFEST).write_text(json.dumps({"step": 3}))
    assert has_complete_checkpoint(other)


def test_fp8_on_a_cpu_is_said(registry):
    def cfg(*overrides):
        return validate_config(load_layers("tiny-llama", list(overrides), resolver(registry)).data)

    warning = fp8_warning(cfg("kernels.fp8=rowwise"), "cpu")
    assert "kernels.fp8=rowwise on CPU" in warning and "one scale per row" in warning
    assert fp8_warning(cfg("kernels.fp8=tensorwise"), "cuda") is None
    assert fp8_warning(cfg(), "cpu") is None
