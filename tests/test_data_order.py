"""Both engines read the same samples in the same order, at any data-parallel size, from a blend of sources too;
and a run resumed at another data-parallel size continues with the next unseen samples (none repeated, none
skipped). Megatron's batches (primus.megatron.data.Batches) and TorchTitan's loader
(primus.torchtitan.data.PrimusDataLoader, whose state rides in its checkpoints) are compared directly."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from primus.core.launch.resolve import resolve

STEPS = 6
GBS, MBS = 8, 2


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    for name, word, n in (("a.jsonl", "alpha", 30), ("b.jsonl", "omega beta", 200)):
        (root / name).write_text(
            "".join(json.dumps({"text": " ".join(f"{word} {i} {j}" for j in range(30))}) + "\n" for i in range(n))
        )
    overrides = [
        f"data.blend=[0.3, {root / 'a.jsonl'}, 0.7, {root / 'b.jsonl'}]",
        "train.seq_len=32",
        f"train.global_batch_size={GBS}",
        f"train.micro_batch_size={MBS}",
        "backend.name=megatron",
    ]
    return resolve("tiny-llama", overrides, world_size=1, check_plugins=False).config


def _megatron(cfg, dp: int, tmp) -> list[list[torch.Tensor]]:
    """steps × [the global batch's tokens, rank by rank]."""
    from primus.megatron.data import build_batches

    ranks = [build_batches(cfg, r, dp, "cpu", tmp) for r in range(dp)]
    return [[t for b in ranks for t, _ in b.micro_batches(step)] for step in range(STEPS)]


def _titan_loaders(cfg, dp: int):
    from primus.torchtitan.data import dataloader_builder

    job = SimpleNamespace(training=SimpleNamespace(local_batch_size=MBS))
    return [dataloader_builder(cfg)(dp_world_size=dp, dp_rank=r, tokenizer=None, job_config=job) for r in range(dp)]


def _titan_steps(loaders, steps: int) -> list[list[torch.Tensor]]:
    its = [iter(x) for x in loaders]
    per_rank = GBS // len(loaders) // MBS
    return [[next(it)[0]["input"] for it in its for _ in range(per_rank)] for _ in range(steps)]


def _rows(batches: list[list[torch.Tensor]]) -> np.ndarray:
    return np.concatenate([torch.cat(step).numpy() for step in batches])


def test_both_engines_read_the_same_blend_at_every_data_parallel_size(cfg, tmp_path):
    want = _rows(_megatron(cfg, 1, tmp_path))
    assert len({tuple(r) for r in want}) == len(want)  # distinct samples (the blend has more than 48)
    for dp in (1, 2, 4):
        assert np.array_equal(_rows(_megatron(cfg, dp, tmp_path)), want), dp
        assert np.array_equal(_rows(_titan_steps(_titan_loaders(cfg, dp), STEPS)), want), dp
    # both sources are in it (alpha and omega documents tokenize differently)
    from primus.core.data.splits import training_samples

    assert set(training_samples(cfg).source[: STEPS * GBS].tolist()) == {0, 1}


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 4)])
def test_resume_at_another_data_parallel_size_continues_with_the_next_samples(cfg, before, after):
    straight = _rows(_titan_steps(_titan_loaders(cfg, 1), STEPS))
    first = _titan_loaders(cfg, before)
    done = _titan_steps(first, 3)
    states = [loader.state_dict() for loader in first]
    assert all(s == {"samples_consumed": 3 * GBS} for s in states)  # the same on every rank: the global position
    resumed = _titan_loaders(cfg, after)
    for loader in resumed:
        loader.load_state_dict(states[0])
    rest = _titan_steps(resumed, STEPS - 3)
    assert np.array_equal(np.concatenate([_rows(done), _rows(rest)]), straight)  # none repeated, none skipped
