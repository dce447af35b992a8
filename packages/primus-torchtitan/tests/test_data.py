"""The data loader: every layout sees the same global batches, split by data-parallel rank; state resumes."""

from __future__ import annotations

import numpy as np
import torch

from primus.torchtitan.data import PrimusDataLoader


class Samples:
    def __init__(self, n: int, seq: int = 4) -> None:
        self.n, self.seq = n, seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        row = np.full(self.seq, i, dtype=np.int64)
        return row, row + 1


def take(loader, batches: int) -> list[torch.Tensor]:
    it = iter(loader)
    return [next(it)[0]["input"][:, 0] for _ in range(batches)]


def test_ranks_split_each_global_batch():
    ds, gbs = Samples(50), 8
    single = torch.cat(
        take(PrimusDataLoader(ds, dp_rank=0, dp_world_size=1, batch_size=2, global_batch_size=gbs, seed=3), 8)
    )
    per_rank = [
        take(PrimusDataLoader(ds, dp_rank=r, dp_world_size=2, batch_size=2, global_batch_size=gbs, seed=3), 4)
        for r in range(2)
    ]
    for step in range(2):  # global batch = rank 0's two micro-batches, then rank 1's
        got = torch.cat([*per_rank[0][2 * step : 2 * step + 2], *per_rank[1][2 * step : 2 * step + 2]])
        assert torch.equal(got, single[step * gbs : (step + 1) * gbs])
    assert len(set(single.tolist())) == 16  # a permutation: no sample twice within an epoch


def test_epochs_reshuffle_and_state_resumes():
    ds = Samples(6)
    loader = PrimusDataLoader(ds, dp_rank=1, dp_world_size=2, batch_size=1, global_batch_size=2, seed=0)
    first = take(loader, 5)
    state = loader.state_dict()
    rest = take(loader, 4)
    again = PrimusDataLoader(ds, dp_rank=1, dp_world_size=2, batch_size=1, global_batch_size=2, seed=0)
    again.load_state_dict(state)
    assert torch.equal(torch.cat(take(again, 4)), torch.cat(rest))
    assert len(first) == 5
    labels = next(iter(again))[1]
    assert labels.dtype == torch.int64 and labels.shape == (1, 4)
