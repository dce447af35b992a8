"""Checkpoints that know they are broken: the manifest records every file (size, checksum); resume, eval and export
take the newest checkpoint that verifies, warn about each newer one naming the file, and refuse naming the files
when none does; a save killed before its manifest never verifies.

Core's stand-in engine (primus.core.run.testing) takes the real ones' place (tests/test_checkpoint_integrity_engines.py
runs both engines): it writes a weights file and a state file, and, like a real engine over a truncated shard, dies
with EOFError loading short weights."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from primus.core.cli.app import app
from primus.core.contracts.errors import UserError
from primus.core.launch.rank import eval_rank, run_rank
from primus.core.launch.resolve import resolve
from primus.core.run import checkpoints as ckpt
from primus.core.run.testing import WEIGHT_BYTES, StandInEngine, registry, weights

pytest.importorskip("torch")  # run_rank detects the device through torch

REGISTRY = registry()


def _resolved(out: Path, *overrides: str):
    base = ["backend.name=stand-in", f"logging.output_dir={out}", "logging.tensorboard=false", "train.steps=4"]
    base += ["checkpoint.interval=1", "checkpoint.keep_last=3", "logging.interval=1"]
    return resolve("tiny-llama", [*base, *overrides], world_size=1, registry=REGISTRY)


def _run(out: Path, *overrides: str, resume: bool = False) -> dict:
    StandInEngine.calls = []
    return run_rank(_resolved(out, *overrides), resume=resume)


def _step(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: WEIGHT_BYTES // 2])


def _delete(path: Path) -> None:
    path.unlink()


def _flip(path: Path) -> None:  # same size, other bytes
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {"truncated": _truncate, "deleted": _delete, "overwritten": _flip}
SAYS = {"truncated": f"{WEIGHT_BYTES // 2} bytes, the manifest records {WEIGHT_BYTES}", "deleted": "missing"}
SAYS["overwritten"] = "blake2b checksum differs from the manifest's (the file was changed)"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of 4 steps with a checkpoint each step, the newest 3 kept (steps 2, 3, 4); copied by each test."""
    out = tmp_path_factory.mktemp("trained") / "run"
    _run(out)
    return out


@pytest.fixture
def run(trained, tmp_path) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "run"))


def test_the_manifest_records_every_file_with_its_size_and_checksum(run):
    man = ckpt.read_manifest(_step(run, 4))
    assert man["files"] == {
        "state.json": {"bytes": len('{"step": 4}'), "blake2b": hashlib.blake2b(b'{"step": 4}').hexdigest()},
        "weights.bin": {"bytes": WEIGHT_BYTES, "blake2b": hashlib.blake2b(weights(4)).hexdigest()},
    }
    assert man["step"] == 4 and man["applied_steps"] == 4 and man["backend"] == "stand-in"  # the keys it had
    assert {"config_hash", "model_shape", "layout", "versions", "time"} <= set(man)
    assert sorted(p.name for p in _step(run, 4).iterdir()) == ["manifest.json", "state.json", "weights.bin"]
    assert [ckpt.verify(_step(run, s)) for s in (2, 3, 4)] == [[], [], []]


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_skips_a_broken_newest_checkpoint_naming_the_file(run, damage, caplog):
    broken = _step(run, 4) / "weights.bin"
    DAMAGE[damage](broken)
    assert ckpt.verify(_step(run, 4)) == [f"{broken}: {SAYS[damage]}"]
    with caplog.at_level(logging.WARNING, logger="primus.core.run.checkpoints"):
        summary = _run(run, "train.steps=6", resume=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(broken) in w and "step 4" in w and SAYS[damage] in w for w in warnings), warnings
    assert summary["start_step"] == 3 and summary["final_step"] == 6 and summary["status"] == "ok"
    assert StandInEngine.calls == [("load", 3), ("train", 4), ("train", 5), ("train", 6)]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows[-3:]] == [(4, 2.5), (5, 2.0), (6, 10 / 6)]
    assert ckpt.verify(_step(run, 4)) == []  # step 4 written again, whole
    assert ckpt.read_manifest(_step(run, 6))["applied_steps"] == 6


def test_every_checkpoint_broken_is_refused_naming_the_files(run):
    for step in (2, 3, 4):
        _truncate(_step(run, step) / "weights.bin")
    with pytest.raises(UserError) as exc:  # not a silent start from step 0
        _run(run, "train.steps=6", resume=True)
    assert isinstance(exc.value, ckpt.CheckpointBroken)
    for step in (2, 3, 4):
        assert f"{_step(run, step) / 'weights.bin'}: {SAYS['truncated']}" in str(exc.value)


def test_a_save_killed_before_its_manifest_never_verifies(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="killed mid-save"):
        _run(out, "backend.extra.fail_save_at=2")
    partial = out / "checkpoints" / "step_00000002.tmp"
    assert sorted(p.name for p in partial.iterdir()) == ["weights.bin"]  # its files, no manifest
    assert ckpt.verify(partial) == [f"{partial}: no manifest.json (an uncommitted or partial save)"]
    assert ckpt.latest(out / "checkpoints", ckpt.NAMING) == (1, _step(out, 1))
    assert ckpt.readable(out / "checkpoints") == _step(out, 1)
    with pytest.raises(ckpt.CheckpointBroken, match=r"step_00000002\.tmp is no committed checkpoint"):
        ckpt.readable(partial)
    summary = _run(out, resume=True)
    assert summary["start_step"] == 1 and StandInEngine.calls[0] == ("load", 1)


def test_each_rank_checksums_its_share_and_the_shares_cover_every_file(run):
    _flip(_step(run, 4) / "state.json")
    full = ckpt.verify(_step(run, 4))
    assert full == [f"{_step(run, 4) / 'state.json'}: {SAYS['overwritten']}"]
    shares = [ckpt.verify(_step(run, 4), share=(r, 3)) for r in range(3)]
    assert sorted(p for s in shares for p in s) == full and sum(map(bool, shares)) == 1
    _truncate(_step(run, 4) / "weights.bin")  # a size is checked by every rank
    assert all(any("weights.bin" in p for p in s) for s in (ckpt.verify(_step(run, 4), share=(r, 3)) for r in range(3)))


def test_atomic_save_over_ranks_merges_their_records(tmp_path):
    world, final = 3, tmp_path / "step_00000005"
    gate = threading.Barrier(world)
    errors = []

    def rank(r: int) -> None:
        def write(tmp: Path) -> None:
            (tmp / f"shard{r}.bin").write_bytes(bytes([r]) * (1000 + r))
            if r == 0:
                (tmp / "sub").mkdir()
                (tmp / "sub" / "common.pt").write_bytes(b"common")

        try:
            ckpt.atomic_save(final, {"step": 5}, r, write, gate.wait, world)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
            gate.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    files = ckpt.read_manifest(final)["files"]
    assert list(files) == ["shard0.bin", "shard1.bin", "shard2.bin", "sub/common.pt"]
    assert [files[f"shard{r}.bin"]["bytes"] for r in range(world)] == [1000, 1001, 1002]
    assert files["sub/common.pt"]["blake2b"] == hashlib.blake2b(b"common").hexdigest()
    assert sorted(p.name for p in final.iterdir()) == ["manifest.json", "shard0.bin", "shard1.bin", "shard2.bin", "sub"]


def test_a_checkpoint_without_a_file_list_verifies_with_a_warning(run, caplog):
    folder = _step(run, 4)
    man = ckpt.read_manifest(folder)
    del man["files"]  # as written before manifests recorded their files
    (folder / "manifest.json").write_text(json.dumps(man))
    _truncate(folder / "weights.bin")
    with caplog.at_level(logging.WARNING, logger="primus.core.run.checkpoints"):
        assert ckpt.verify(folder) == []
    assert f"{folder} was written before checkpoints recorded their files" in caplog.text


def test_eval_and_export_take_the_newest_checkpoint_that_verifies(run, caplog):
    broken = _step(run, 4) / "weights.bin"
    _truncate(broken)
    res = _resolved(run, "eval.holdout=0.1", "eval.batches=1")
    with caplog.at_level(logging.WARNING, logger="primus.core.run.checkpoints"):
        assert eval_rank(res, run / "checkpoints")["step"] == 3  # primus eval --checkpoint ROOT
    assert str(broken) in caplog.text
    with pytest.raises(ckpt.CheckpointBroken, match=f"{broken}: {SAYS['truncated']}"):
        eval_rank(res, _step(run, 4))  # the broken one itself: named, not an EOFError
    assert ckpt.readable(run / "checkpoints") == _step(run, 3)
    _flip(_step(run, 3) / "state.json")  # only a checksum finds this one: export reads them
    assert ckpt.readable(run / "checkpoints") == _step(run, 2)
    with pytest.raises(ckpt.CheckpointBroken, match=r"step_00000003/state\.json: blake2b checksum differs"):
        ckpt.readable(_step(run, 3))


def test_primus_checkpoint_verify_and_export_refuse_naming_the_file(run):
    runner = CliRunner()
    ok = runner.invoke(app, ["checkpoint", "verify", str(_step(run, 4))])
    assert ok.exit_code == 0 and ok.output.startswith(f"OK {_step(run, 4)} (step 4, 2 files, 0.2 MiB)")
    _flip(_step(run, 4) / "weights.bin")
    bad = runner.invoke(app, ["checkpoint", "verify", str(run / "checkpoints")])
    assert bad.exit_code == 2
    lines = bad.output.splitlines()
    assert lines[0].startswith(f"OK {_step(run, 2)}") and lines[1].startswith(f"OK {_step(run, 3)}")
    assert lines[2] == f"BROKEN {_step(run, 4)} (step 4):" and f"{_step(run, 4) / 'weights.bin'}: blake2b" in lines[3]
    out = runner.invoke(app, ["checkpoint", "export", str(_step(run, 4)), "--to-hf", str(run / "hf")])
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert out.output.startswith(f"error: checkpoint {_step(run, 4)} is broken: {_step(run, 4) / 'weights.bin'}")
    assert not (run / "hf").exists()
