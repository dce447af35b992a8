"""PackedDataset: fixed-length next-token windows over one stream."""

from __future__ import annotations

import numpy as np
import pytest

from primus.core.data import PackedDataset


def test_windows_and_labels():
    tokens = np.arange(100, 123, dtype=np.int32)  # 23 tokens
    ds = PackedDataset(tokens, seq_len=5)
    assert len(ds) == (23 - 1) // 5 == 4
    inputs, labels = ds[0]
    assert inputs.dtype == labels.dtype == np.int64
    assert inputs.tolist() == [100, 101, 102, 103, 104] and labels.tolist() == [101, 102, 103, 104, 105]
    inputs, labels = ds[3]
    assert inputs.tolist() == [115, 116, 117, 118, 119] and labels.tolist() == [116, 117, 118, 119, 120]
    assert ds[-1][0].tolist() == ds[3][0].tolist()
    with pytest.raises(IndexError):
        ds[4]
    assert [x.tolist() for x, _ in ds] == [list(range(100 + 5 * i, 105 + 5 * i)) for i in range(4)]


def test_exact_fit_needs_one_extra_token_for_the_last_label():
    assert len(PackedDataset(np.arange(20), 5)) == 3
    assert len(PackedDataset(np.arange(21), 5)) == 4
    assert len(PackedDataset(np.arange(1), 5)) == len(PackedDataset(np.arange(0), 5)) == 0


def test_items_are_independent_copies_of_a_read_only_stream():
    tokens = np.arange(50, dtype=np.int32)
    tokens.setflags(write=False)  # streams come memory-mapped read-only from the cache
    inputs, labels = PackedDataset(tokens, 8)[1]
    inputs[0] = -1
    assert labels[0] == 9 and tokens[8] == 8


def test_bad_arguments():
    with pytest.raises(ValueError, match="1-D integer"):
        PackedDataset(np.zeros((2, 3), dtype=np.int32), 2)
    with pytest.raises(ValueError, match="1-D integer"):
        PackedDataset(np.zeros(8, dtype=np.float32), 2)
    with pytest.raises(ValueError, match="seq_len"):
        PackedDataset(np.arange(8), 0)


def test_torch_dataloader_collates_batches():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    loader = DataLoader(PackedDataset(np.arange(41, dtype=np.int32), 4), batch_size=3, shuffle=False)
    inputs, labels = next(iter(loader))
    assert inputs.dtype == torch.int64 and inputs.shape == (3, 4)
    assert torch.equal(labels, inputs + 1)
    assert inputs[2].tolist() == [8, 9, 10, 11]


def test_global_order_is_a_fresh_seeded_permutation_each_epoch():
    from primus.core.data import GlobalOrder

    order = GlobalOrder(7, seed=3)
    epochs = [[order[e * 7 + i] for i in range(7)] for e in range(3)]
    assert all(sorted(e) == list(range(7)) for e in epochs)  # every sample once per epoch
    assert epochs[0] != epochs[1]  # reshuffled
    again = GlobalOrder(7, seed=3)
    assert [again[k] for k in range(21)] == [x for e in epochs for x in e]  # seeded: both engines read this order
    assert [again[k] for k in range(7)] != [GlobalOrder(7, seed=4)[k] for k in range(7)]
    assert [GlobalOrder(5, seed=3, shuffle=False)[k] for k in range(7)] == [0, 1, 2, 3, 4, 0, 1]
    with pytest.raises(ValueError, match="no complete sample"):
        GlobalOrder(0, seed=1)
