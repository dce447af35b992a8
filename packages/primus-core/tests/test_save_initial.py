"""``train.save_initial``: core writes the weights a run starts from (the engine's ``save_weights``), committed like a
checkpoint, on every engine; core's stand-in engine (primus.core.run.testing) takes a real one's place
(the engines' own tests load the folder with ``train.init_from`` on other layouts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from primus.core import hookimpl
from primus.core.contracts.engine import BackendSpec
from primus.core.contracts.errors import UserError
from primus.core.launch.rank import run_rank
from primus.core.launch.resolve import resolve
from primus.core.run.checkpoints import verify
from primus.core.run.testing import StandInEngine, registry, weights

pytest.importorskip("torch")  # run_rank detects the device through torch


class WeightsOnlyNot(StandInEngine):
    save_weights = None  # an engine that cannot write its weights alone


class _Backend:
    @staticmethod
    @hookimpl
    def primus_backends():
        return [BackendSpec("no-weights", "", engine=WeightsOnlyNot)]


REGISTRY = registry(("no-weights", _Backend))


def _run(out: Path, *overrides: str, backend: str = "stand-in", resume: bool = False) -> dict:
    base = [f"backend.name={backend}", f"logging.output_dir={out}", "logging.tensorboard=false", "train.steps=3"]
    StandInEngine.calls = []
    return run_rank(resolve("tiny-llama", [*base, *overrides], world_size=1, registry=REGISTRY), resume=resume)


def test_the_initial_weights_are_committed_once_and_never_written_over(tmp_path, caplog):
    seed = tmp_path / "seed"
    assert _run(tmp_path / "a", f"train.save_initial={seed}")["status"] == "ok"
    man = json.loads((seed / "manifest.json").read_text())
    assert man["step"] == 0 and man["backend"] == "stand-in" and man["model_name"] == "tiny-llama"
    assert man["weights_only"] == {
        "model_shape": man["model_shape"],
        "seed": 1234,
        "init": "canonical",
        "init_from": None,
    }
    assert (seed / "weights.bin").read_bytes() == weights(0) and verify(seed) == []  # files recorded, checksums
    assert sorted(p.name for p in seed.iterdir()) == ["manifest.json", "weights.bin"]  # no optimizer, no state
    assert StandInEngine.calls[0] == ("train", 1)  # then it trained

    # the same run again (restarted before its first checkpoint): the same weights, kept as they are
    before = (seed / "manifest.json").read_text()
    with caplog.at_level("INFO", logger="primus"):
        assert _run(tmp_path / "b", f"train.save_initial={seed}")["status"] == "ok"
    assert (seed / "manifest.json").read_text() == before and "already holds this run's initial weights" in caplog.text

    # other weights (another seed) never go over them, nor into any other folder: refused before step 1
    with pytest.raises(UserError, match=rf"train.save_initial: {seed} exists; load it with train.init_from={seed}"):
        _run(tmp_path / "c", f"train.save_initial={seed}", "train.seed=7")
    assert StandInEngine.calls == [] and (seed / "manifest.json").read_text() == before
    (tmp_path / "plain").mkdir()
    with pytest.raises(UserError, match="exists"):
        _run(tmp_path / "d", f"train.save_initial={tmp_path / 'plain'}")


def test_a_resumed_run_writes_no_initial_weights(tmp_path):
    out = tmp_path / "run"
    _run(out, "checkpoint.interval=2", "train.steps=2")
    seed = tmp_path / "seed"
    summary = _run(out, "checkpoint.interval=2", f"train.save_initial={seed}", resume=True)
    assert summary["start_step"] == 2 and not seed.exists()


def test_an_engine_that_cannot_write_its_weights_alone_is_refused_naming_the_backend(tmp_path):
    with pytest.raises(UserError, match="train.save_initial: backend 'no-weights'.s engine cannot write"):
        _run(tmp_path / "run", f"train.save_initial={tmp_path / 'seed'}", backend="no-weights")
    assert not (tmp_path / "seed").exists()
