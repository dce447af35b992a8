"""A resume never changes the data order unsaid: each checkpoint records its data sources (size, time, sampled
bytes), train.seed, the global batch, seq_len and holdout; a resume where one changed is refused in one line naming
it, old and new (exit 2), unless checkpoint.allow_data_change (then a warning names it); another global batch is
always refused; a checkpoint written before fingerprints resumes with a warning.

Core's stand-in engine (primus.core.run.testing) takes a real engine's place; paths are relative to the test's folder,
so that each test's copy of the first run is that run."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from primus.core.cli.app import app
from primus.core.contracts import plugins
from primus.core.launch.rank import run_rank
from primus.core.launch.resolve import resolve
from primus.core.run import checkpoints as ckpt
from primus.core.run.testing import StandInEngine, registry

pytest.importorskip("torch")  # run_rank detects the device through torch

REGISTRY = registry()
DOCS = [{"text": f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 5 + 1)} for i in range(40)]
BASE = ["backend.name=stand-in", "logging.output_dir=run", "logging.tensorboard=false", "data.source=data.jsonl"]
BASE += ["train.global_batch_size=4", "train.micro_batch_size=4", "checkpoint.interval=2"]
STEP4 = Path("run/checkpoints/step_00000004")


def _write(path: Path, docs: list[dict]) -> None:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """4 steps over data.jsonl, checkpoints at steps 2 and 4: the folder holding data.jsonl and run/."""
    base = tmp_path_factory.mktemp("first")
    _write(base / "data.jsonl", DOCS)
    cwd = os.getcwd()
    os.chdir(base)
    try:
        run_rank(resolve("tiny-llama", [*BASE, "train.steps=4"], world_size=1, registry=REGISTRY))
    finally:
        os.chdir(cwd)
    return base


@pytest.fixture
def here(first_run, tmp_path, monkeypatch) -> Path:
    """A copy of the first run (times kept), the working folder; the CLI sees core and the stand-in engine."""
    work = Path(shutil.copytree(first_run, tmp_path / "work"))
    monkeypatch.chdir(work)
    monkeypatch.setattr(plugins, "_cached", REGISTRY)
    StandInEngine.calls = []
    return work


def _resume(*overrides: str):
    return CliRunner().invoke(app, ["train", "tiny-llama", *BASE, "train.steps=6", *overrides, "--resume"])


def _resume_in_process(*overrides: str) -> dict:  # its warnings in caplog (the CLI's console wraps lines)
    return run_rank(resolve("tiny-llama", [*BASE, "train.steps=6", *overrides], world_size=1, registry=REGISTRY), True)


def _refused(res, *says: str) -> str:
    """The one error line of a refused resume (exit 2, no traceback, nothing loaded or trained)."""
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    for text in says:
        assert text in errors[0], errors[0]
    assert StandInEngine.calls == []
    assert not Path("run/checkpoints/step_00000006").exists()
    return errors[0]


def test_the_manifest_records_the_data_fingerprint(first_run):
    data = ckpt.read_manifest(first_run / STEP4)[ckpt.DATA_KEY]
    size = (first_run / "data.jsonl").stat().st_size
    assert data["settings"] == {
        "train.global_batch_size": 4,
        "train.seed": 1234,
        "train.seq_len": 128,
        "eval.holdout": 0.0,
    }
    [source] = data["sources"]
    assert source["key"] == "data.source" and source["path"] == "data.jsonl"
    assert source["files"] == 1 and source["bytes"] == size and len(source["blake2b"]) == 32


def test_an_unchanged_resume_proceeds(here):
    res = _resume()
    assert res.exit_code == 0, res.output
    assert StandInEngine.calls[:2] == [("load", 4), ("train", 5)]
    assert "data fingerprint" not in res.output and "allow_data_change" not in res.output
    man = ckpt.read_manifest(here / "run/checkpoints/step_00000006")
    assert man[ckpt.DATA_KEY] == ckpt.read_manifest(here / STEP4)[ckpt.DATA_KEY]


def test_a_truncated_data_file_is_refused_naming_it(here):
    before = (here / "data.jsonl").stat().st_size
    _write(here / "data.jsonl", DOCS[:30])
    after = (here / "data.jsonl").stat().st_size
    line = _refused(_resume(), f"cannot resume {STEP4}", "data.source data.jsonl changed")
    assert f"({before} bytes, modified " in line and f"in the checkpoint; {after} bytes, modified " in line
    assert "checkpoint.allow_data_change=true" in line


def test_another_seed_is_refused_and_allow_data_change_takes_it_with_a_warning(here, caplog):
    _refused(_resume("train.seed=7"), "its data order would change: train.seed 1234 in the checkpoint, 7 now")
    logging.getLogger().addHandler(caplog.handler)  # the CLI's logging setup replaced the root's handlers
    with caplog.at_level(logging.WARNING, "primus.core.run.checkpoints"):
        summary = _resume_in_process("train.seed=7", "checkpoint.allow_data_change=true")
    assert summary["start_step"] == 4 and StandInEngine.calls[:2] == [("load", 4), ("train", 5)]
    says = f"checkpoint.allow_data_change: resuming {STEP4} although train.seed 1234 in the checkpoint, 7 now"
    assert says in [r.getMessage() for r in caplog.records]


def test_another_global_batch_is_refused_even_when_allowed(here):
    says = "train.global_batch_size 4 in the checkpoint, 8 now: a resumed run continues at step × global batch"
    _refused(_resume("train.global_batch_size=8", "train.micro_batch_size=8"), says, "train.init_from=")
    _refused(
        _resume("train.global_batch_size=8", "train.micro_batch_size=8", "checkpoint.allow_data_change=true"), says
    )


def test_same_content_with_a_newer_time_resumes_with_a_warning(here, caplog):
    os.utime(here / "data.jsonl", (1e9, 2e9))  # a copy that did not keep the times: same bytes
    with caplog.at_level(logging.WARNING, "primus.core.run.checkpoints"):
        summary = _resume_in_process()
    assert summary["start_step"] == 4 and summary["final_step"] == 6
    assert any("taken as the same data" in r.getMessage() for r in caplog.records)


def test_a_checkpoint_without_fingerprint_resumes_with_a_warning(here, caplog):
    manifest = here / STEP4 / ckpt.MANIFEST
    man = json.loads(manifest.read_text())
    del man[ckpt.DATA_KEY]
    manifest.write_text(json.dumps(man))
    with caplog.at_level(logging.WARNING, "primus.core.run.checkpoints"):
        summary = _resume_in_process()
    assert summary["start_step"] == 4
    [note] = [r.getMessage() for r in caplog.records if "data fingerprint" in r.getMessage()]
    assert note.startswith(f"checkpoint {STEP4} records no data fingerprint (written by an earlier Primus)")


def test_blend_weights_and_a_folder_gaining_a_file_are_changes(tmp_path):
    from primus.core.data.fingerprint import changes, fingerprint

    (tmp_path / "b").mkdir()
    _write(tmp_path / "a.jsonl", DOCS)
    _write(tmp_path / "b" / "1.jsonl", DOCS[:10])

    def taken(weight_a: float) -> dict:
        blend = f"data.blend=[{weight_a}, {tmp_path / 'a.jsonl'}, 0.5, {tmp_path / 'b'}]"
        return fingerprint(resolve("tiny-llama", [blend], world_size=1, check_plugins=False).config)

    saved = taken(0.5)
    assert [s["key"] for s in saved["sources"]] == ["data.blend[0].path", "data.blend[1].path"]
    assert changes(saved, taken(0.5)) == []
    _write(tmp_path / "b" / "2.jsonl", DOCS[10:])
    found = changes(saved, taken(0.7))
    assert found[0] == "data.blend[0].weight 0.5 in the checkpoint, 0.7 now"
    assert found[1].startswith(f"data.blend[1].path {tmp_path / 'b'} changed (") and " 2 files, " in found[1]
    assert len(found) == 2
