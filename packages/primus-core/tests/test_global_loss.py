"""Core's ``loss`` metric over ranks (primus.core.run.metrics.global_token_loss), on 2 gloo processes: each rank's
(token-loss sum, tokens) summed, then the per-token mean, the same on every rank; a rank that reports none adds
zeros; a NaN on one rank is NaN on all."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def _rank(rank: int, folder: str) -> None:
    import torch.distributed as dist

    from primus.core.run.metrics import global_token_loss

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    try:
        mine = {0: [6.0, 3.0], 1: [2.0, 1.0]}[rank]
        silent = {0: [6.0, 3.0], 1: [0.0, 0.0]}[rank]  # rank 1: a pipeline stage before the last
        bad = {0: [6.0, 3.0], 1: [math.nan, 1.0]}[rank]
        got = [global_token_loss(torch.tensor(x, dtype=torch.float64)) for x in (mine, silent, bad)]
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_the_global_loss_is_the_world_token_mean_on_every_rank(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(str(tmp_path),), nprocs=2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got[:2] == [2.0, 2.0] and math.isnan(got[2])
    one = torch.tensor([6.0, 4.0], dtype=torch.float64)  # no process group: this rank's own mean

    from primus.core.run.metrics import global_token_loss

    assert global_token_loss(one) == 1.5
