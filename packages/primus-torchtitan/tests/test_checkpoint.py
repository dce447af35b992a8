"""The pieces of the atomic checkpoints, in-process: the hook into torchtitan's CheckpointManager (and that
torchtitan 0.2.2 still calls what it replaces), which folders count as checkpoints, keep-last, the data
position across data-parallel sizes, and what validate refuses. Whole runs: test_checkpoint_resume.py,
test_crash_safety.py."""

from __future__ import annotations

import inspect
import json

import pytest
from conftest import TINY
from test_data import Samples, take

from primus.core import checkpoints as core
from primus.core.config.errors import ConfigError
from primus.core.train import resolve
from primus.torchtitan import compat
from primus.torchtitan.checkpoint import NAMING, AtomicCheckpointManager, check_compatible, complete_steps
from primus.torchtitan.data import PrimusDataLoader

REPLACED = ("dcp_save", "dcp_load", "load", "_find_load_step", "_purge_stale_checkpoints")


def test_trainer_builds_its_checkpointer_through_the_swapped_name():
    import torchtitan.train as tt_train
    from torchtitan.components.checkpoint import CheckpointManager

    assert "self.checkpointer = CheckpointManager(" in inspect.getsource(tt_train.Trainer.__init__)
    factory = object()
    with compat.checkpoint_manager_class(factory):
        assert tt_train.CheckpointManager is factory
    assert tt_train.CheckpointManager is CheckpointManager


def test_replaced_methods_keep_torchtitans_signatures_and_call_sites():
    from torchtitan.components.checkpoint import CheckpointManager

    for name in REPLACED:
        ours, theirs = inspect.signature(getattr(AtomicCheckpointManager, name)), getattr(CheckpointManager, name)
        assert list(ours.parameters) == list(inspect.signature(theirs).parameters), name
    src = {m: inspect.getsource(getattr(CheckpointManager, m)) for m in ("save", "_save_last_step", "load")}
    assert "self.dcp_save(" in src["save"] and "self.dcp_save(" in src["_save_last_step"]
    assert "self._purge_stale_checkpoints()" in src["save"]
    assert "self._find_load_step()" in src["load"] and "self.dcp_load(" in src["load"]
    # the initial weights are loaded only while the folder does not exist (AtomicCheckpointManager.load)
    assert "if not os.path.exists(self.folder):" in src["load"] and "self.initial_load_path" in src["load"]
    assert 'f"step-{step}"' in inspect.getsource(CheckpointManager._create_checkpoint_id)  # NAMING's names


def _checkpoint(root, name, step=None, **manifest):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"shard")
    if step is not None:
        (folder / core.MANIFEST).write_text(json.dumps({"step": step, **manifest}))
    return folder


def test_partial_folders_never_shadow_a_complete_checkpoint(tmp_path):
    _checkpoint(tmp_path, "step-3", 3)
    _checkpoint(tmp_path, "step-9.tmp")  # a save cut short before its commit
    _checkpoint(tmp_path, "step-12")  # the final name without a manifest (DCP's .metadata alone is not enough)
    (tmp_path / "step-12" / ".metadata").write_bytes(b"")
    _checkpoint(tmp_path, "step-15", 6)  # a manifest of another step
    _checkpoint(tmp_path, "step-21.tmp", 21)  # a manifest, but never renamed
    assert complete_steps(tmp_path) == [3]
    assert core.latest(tmp_path, NAMING) == (3, tmp_path / "step-3")


def test_keep_last_counts_complete_checkpoints_and_keeps_later_partial_saves(tmp_path):
    for step in (2, 4, 6):
        _checkpoint(tmp_path, f"step-{step}", step)
    _checkpoint(tmp_path, "step-5.tmp")  # superseded by the complete step 6
    _checkpoint(tmp_path, "step-8.tmp")  # newer than every complete one: kept for inspection
    core.purge(tmp_path, NAMING, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-6", "step-8.tmp"]


def test_shape_check_names_the_mismatch(tmp_path):
    res = resolve(TINY, [], 1)
    folder = _checkpoint(tmp_path, "step-4", 4, model_name="other", model_shape=core.model_shape(res.config))
    assert check_compatible(folder, res.config)["step"] == 4
    wider = resolve(TINY, ["model.hidden_size=256"], 1).config
    with pytest.raises(
        core.CheckpointMismatch, match=r"another shape \(hidden_size 128 vs 256, kv_channels 32 vs 64\)"
    ):
        check_compatible(folder, wider)
    with pytest.raises(core.CheckpointMismatch, match="no manifest.json: not a complete primus-torchtitan"):
        check_compatible(_checkpoint(tmp_path, "step-8"), res.config)


def _loaders(dp: int, ds, gbs: int = 8, mbs: int = 2) -> list[PrimusDataLoader]:
    return [
        PrimusDataLoader(ds, dp_rank=r, dp_world_size=dp, batch_size=mbs, global_batch_size=gbs, seed=5)
        for r in range(dp)
    ]


def _global_batches(loaders, steps: int) -> list[list[int]]:
    """Sample ids of each global batch: rank 0's micro-batches, then rank 1's, ..."""
    per_rank = [take(loader, steps * loader.local_batch // loader.batch_size) for loader in loaders]
    n = len(per_rank[0]) // steps
    return [sum((b.tolist() for r in per_rank for b in r[s * n : (s + 1) * n]), []) for s in range(steps)]


@pytest.mark.parametrize(("saved_dp", "resumed_dp"), [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_data_position_carries_over_to_another_data_parallel_size(saved_dp, resumed_dp):
    ds = Samples(40)
    straight = _global_batches(_loaders(1, ds), 6)
    before = _loaders(saved_dp, ds)
    assert _global_batches(before, 3) == straight[:3]
    states = [loader.state_dict() for loader in before]
    assert all(s == {"samples_consumed": 24} for s in states)  # one global value, the same on every rank
    after = _loaders(resumed_dp, ds)
    for loader in after:
        loader.load_state_dict(states[0])
    assert _global_batches(after, 3) == straight[3:]  # no sample repeated or skipped


def test_data_position_refuses_a_partial_global_batch():
    loader = _loaders(2, Samples(40), gbs=12)[0]
    with pytest.raises(ValueError, match="consumed 28 samples, not a whole number of global batches of 12"):
        loader.load_state_dict({"samples_consumed": 28})  # saved with a global batch of 4


def test_validate_refuses_async_checkpoints_and_unknown_fault_injectors():
    with pytest.raises(ConfigError) as err:
        resolve(TINY, ["backend.extra.checkpoint.async_mode=async"], 1)
    assert "backend.extra.checkpoint.async_mode" in str(err.value) and "synchronous" in str(err.value)
    with pytest.raises(ConfigError) as err:
        resolve(TINY, ["backend.extra.fault_injection.kill_at=3"], 1)
    assert "unknown key kill_at" in str(err.value)
    res = resolve(TINY, ["backend.extra.fault_injection.kill_during_save_at_step=3"], 1)
    jc = compat.build_job_config(
        res.config, model_name="x", flavor="primus", output_dir="o", checkpoint_dir="c", gpu=False
    )
    assert jc.checkpoint.async_mode == "disabled"  # fault_injection is Primus's, not given to torchtitan
