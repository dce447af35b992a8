"""The pieces of the checkpoints, in-process: the torchtitan checkpointer calls the engine's save / load /
initial load make (and that torchtitan 0.2.2 still has them as used), which folders count as checkpoints,
keep-last, the data position across data-parallel sizes, and what validate refuses. Whole runs:
test_checkpoint_resume.py, test_crash_safety.py."""

from __future__ import annotations

import inspect
import json

import pytest
from conftest import TINY
from test_data import Samples, take

from primus.core.config.errors import ConfigError
from primus.core.launch.resolve import resolve
from primus.core.run import checkpoints as core
from primus.torchtitan import job_config
from primus.torchtitan.checkpoint import NAMING, check_compatible, complete_steps
from primus.torchtitan.data import PrimusDataLoader


def test_checkpointer_calls_keep_torchtitans_signatures():
    """primus.torchtitan.checkpoint calls CheckpointManager's dcp_save / dcp_load and the private
    _flattened_model_states_sd / _states_to_load with these parameters."""
    from torchtitan.components.checkpoint import CheckpointManager

    def params(name):
        return list(inspect.signature(getattr(CheckpointManager, name)).parameters)

    assert params("dcp_save") == [
        "self",
        "state_dict",
        "checkpoint_id",
        "async_mode",
        "enable_garbage_collection",
        "to_hf",
    ]
    assert params("dcp_load") == ["self", "state_dict", "checkpoint_id", "from_hf", "from_quantized"]
    assert params("_flattened_model_states_sd") == ["self", "state_dict"]
    assert params("_states_to_load") == ["self", "model_only"]
    assert "self.exclude_from_loading" in inspect.getsource(CheckpointManager._states_to_load)


def test_native_format_is_still_torchtitans():
    """primus.torchtitan.native reads plain torchtitan's checkpoints by the layout its CheckpointManager writes: the
    state names, the step-N folders counted complete by their .metadata (or a safetensors index), the model
    flattened to the top level, the optimizer state flattened per parameter."""
    from torchtitan.components import checkpoint as tt
    from torchtitan.components.optimizer import OptimizersContainer

    from primus.torchtitan import native

    assert set(native.STATES) == {tt.OPTIMIZER, tt.LR_SCHEDULER, tt.DATALOADER, tt.TRAIN_STATE}
    find = inspect.getsource(tt.CheckpointManager._find_load_step)
    assert native.STEP.pattern in find and '".metadata"' in find and f'"{native.HF_INDEX}"' in find
    assert native.DCP_METADATA == ".metadata"
    assert 'f"step-{step}"' in inspect.getsource(tt.CheckpointManager._create_checkpoint_id)
    assert "sd.update(states[MODEL].state_dict())" in inspect.getsource(tt.CheckpointManager._flattened_model_states_sd)
    assert "flatten_optimizer_state_dict=True" in inspect.getsource(OptimizersContainer.state_dict)
    assert "flatten_optimizer_state_dict=True" in inspect.getsource(OptimizersContainer.load_state_dict)


def _checkpoint(root, name, step=None, **manifest):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"shard")
    if step is not None:
        (folder / core.MANIFEST).write_text(json.dumps({"step": step, **manifest}))
    return folder


def test_partial_folders_never_shadow_a_complete_checkpoint(tmp_path):
    _checkpoint(tmp_path, "step_00000003", 3)
    _checkpoint(tmp_path, "step_00000009.tmp")  # a save cut short before its commit
    _checkpoint(tmp_path, "step_00000012")  # the final name without a manifest (DCP's .metadata alone is not enough)
    (tmp_path / "step_00000012" / ".metadata").write_bytes(b"")
    _checkpoint(tmp_path, "step_00000015", 6)  # a manifest of another step
    _checkpoint(tmp_path, "step_00000021.tmp", 21)  # a manifest, but never renamed
    assert complete_steps(tmp_path) == [3]
    assert core.latest(tmp_path, NAMING) == (3, tmp_path / "step_00000003")


def test_keep_last_counts_complete_checkpoints_and_keeps_later_partial_saves(tmp_path):
    for step in (2, 4, 6):
        _checkpoint(tmp_path, f"step_{step:08d}", step)
    _checkpoint(tmp_path, "step_00000005.tmp")  # superseded by the complete step 6
    _checkpoint(tmp_path, "step_00000008.tmp")  # newer than every complete one: kept for inspection
    core.purge(tmp_path, NAMING, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000006", "step_00000008.tmp"]


def test_shape_check_names_the_mismatch(tmp_path):
    res = resolve(TINY, [], 1)
    folder = _checkpoint(tmp_path, "step_00000004", 4, model_name="other", model_shape=core.model_shape(res.config))
    assert check_compatible(folder, res.config)["step"] == 4
    wider = resolve(TINY, ["model.hidden_size=256"], 1).config
    with pytest.raises(
        core.CheckpointMismatch, match=r"another shape \(hidden_size 128 vs 256, kv_channels 32 vs 64\)"
    ):
        check_compatible(folder, wider)
    with pytest.raises(core.CheckpointMismatch, match="no manifest.json: not a complete primus-torchtitan"):
        check_compatible(_checkpoint(tmp_path, "step_00000008"), res.config)


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
    jc = job_config.build_job_config(
        res.config, model_name="x", flavor="primus", output_dir="o", checkpoint_dir="c", gpu=False
    )
    assert jc.checkpoint.async_mode == "disabled"  # fault_injection is Primus's, not given to torchtitan
