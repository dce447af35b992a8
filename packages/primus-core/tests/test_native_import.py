"""``primus checkpoint import --from PATH``: core's side, with the stand-in engine's own trainer's checkpoints
(primus.core.run.testing): which backend recognises a path, the refusals, the committed checkpoint and its resume.
The engines' own formats (Megatron-LM's, TorchTitan's) are tested in the cross-package tests with their savers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from primus.core.contracts.errors import UserError
from primus.core.launch.native import import_native_run, recognised_or_refused
from primus.core.launch.rank import run_rank
from primus.core.launch.resolve import resolve
from primus.core.run.checkpoints import read_manifest, verify
from primus.core.run.testing import TRAINER_FILE, StandInEngine, registry, weights

pytest.importorskip("torch")  # run_rank detects the device through torch

REGISTRY = registry()


def _trainer_checkpoint(folder: Path, step: int, optimizer: bool = True, **more) -> Path:
    folder.mkdir(parents=True)
    (folder / TRAINER_FILE).write_text(json.dumps({"step": step, "optimizer": optimizer, **more}))
    return folder


def test_import_commits_a_checkpoint_that_resumes_at_the_source_step(tmp_path):
    source = _trainer_checkpoint(tmp_path / "theirs" / "iter_7", 7)
    out = tmp_path / "run"
    StandInEngine.calls = []
    done = import_native_run("tiny-llama", [f"logging.output_dir={out}"], source, None, None, REGISTRY)
    assert done == out / "checkpoints" / "step_00000007"
    assert StandInEngine.calls == [("load_native", 7, False)]
    man = read_manifest(done)
    assert man["step"] == 7 and man["applied_steps"] == 7 and man["backend"] == "stand-in"
    assert man["imported"] == {
        "source": "the stand-in trainer",
        "path": str(source.absolute()),
        "step": 7,
        "what": "stand-in trainer checkpoint, step 7",
    }
    assert "weights_only" not in man and verify(done) == []
    assert (done / "weights.bin").read_bytes() == weights(7)
    saved = (out / "config.yaml").read_text()
    assert "backend:\n  name: stand-in" in saved and "source: bundled" in saved  # the user's data, not the import's

    # the same config continues it: the step after the source's, its weights loaded
    StandInEngine.calls = []
    overrides = ["backend.name=stand-in", f"logging.output_dir={out}", "logging.tensorboard=false", "train.steps=9"]
    summary = run_rank(resolve("tiny-llama", overrides, world_size=1, registry=REGISTRY), resume=True)
    assert summary["start_step"] == 7 and summary["final_step"] == 9
    assert StandInEngine.calls[:3] == [("load", 7), ("train", 8), ("train", 9)]

    # a second import into the same run folder is refused, nothing written
    with pytest.raises(UserError, match="holds an earlier run"):
        import_native_run("tiny-llama", [f"logging.output_dir={out}"], source, None, None, REGISTRY)


def test_without_optimizer_state_the_weights_alone(tmp_path):
    source = _trainer_checkpoint(tmp_path / "theirs", 3, optimizer=False)
    StandInEngine.calls = []
    done = import_native_run("tiny-llama", [f"logging.output_dir={tmp_path / 'run'}"], source, None, None, REGISTRY)
    assert done == tmp_path / "run" / "imported" / "step_00000003"
    assert StandInEngine.calls == [("load_native", 3, True)]
    man = read_manifest(done)
    assert man["weights_only"]["init_from"] == str(source)
    assert sorted(p.name for p in done.iterdir()) == ["manifest.json", "weights.bin"]


def test_weights_only_from_a_source_with_optimizer_state(tmp_path):
    source = _trainer_checkpoint(tmp_path / "theirs", 5)
    StandInEngine.calls = []
    words = [f"logging.output_dir={tmp_path / 'run'}"]
    done = import_native_run("tiny-llama", words, source, None, None, REGISTRY, weights_only=True)
    assert done == tmp_path / "run" / "imported" / "step_00000005"
    assert StandInEngine.calls == [("load_native", 5, True)] and "weights_only" in read_manifest(done)


def test_the_checkpoint_model_is_the_run_model(tmp_path):
    """A checkpoint that records its model (as Megatron-LM's arguments do) needs no config; one that records none
    is refused without one, naming what to give."""
    model = {"name": "theirs", "hidden_size": 64, "num_layers": 3, "num_attention_heads": 4, "num_kv_heads": 4}
    source = _trainer_checkpoint(tmp_path / "a", 2, model=model)
    done = import_native_run(None, [f"logging.output_dir={tmp_path / 'run'}"], source, None, None, REGISTRY)
    man = read_manifest(done)
    assert man["model_name"] == "theirs" and man["model_shape"]["num_layers"] == 3
    bare = _trainer_checkpoint(tmp_path / "b", 2)
    with pytest.raises(ValueError, match="records no model config: give CONFIG"):
        import_native_run(None, [], bare, None, None, REGISTRY)


def test_refusals_say_what_the_path_is_and_what_is_expected(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        UserError,
        match=r"not a checkpoint an installed backend imports; expected .*a stand-in trainer checkpoint \(a folder",
    ):
        recognised_or_refused(tmp_path / "empty", REGISTRY)
    with pytest.raises(UserError, match="no such file or folder"):
        recognised_or_refused(tmp_path / "gone", REGISTRY)
    old = _trainer_checkpoint(tmp_path / "old", 4, broken="written in the old format: convert it first")
    with pytest.raises(UserError, match="stand-in trainer checkpoint, step 4: written in the old format"):
        recognised_or_refused(old, REGISTRY)
    primus = tmp_path / "primus" / "step_00000001"
    primus.mkdir(parents=True)
    (primus / "manifest.json").write_text(json.dumps({"step": 1}))
    with pytest.raises(UserError, match="a Primus checkpoint already"):
        recognised_or_refused(primus.parent, REGISTRY)
    assert not (tmp_path / "outputs").exists()
