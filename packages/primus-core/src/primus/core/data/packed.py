"""Fixed-length next-token samples cut from one token stream."""

from __future__ import annotations

import numpy as np


class PackedDataset:
    """Sample ``i`` is ``tokens[i*s:(i+1)*s]`` as inputs and the same window shifted by one as labels.

    Samples do not overlap and cross document boundaries (the EOS tokens in the stream mark them).
    ``len == (len(tokens) - 1) // seq_len``; items are int64 numpy arrays of shape ``[seq_len]``, which
    torch's default collate turns into tensors.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for {n} samples")
        start = (index % n) * self.seq_len
        inputs = self.tokens[start : start + self.seq_len].astype(np.int64)
        labels = self.tokens[start + 1 : start + self.seq_len + 1].astype(np.int64)
        return inputs, labels


class GlobalOrder:
    """Which sample sits at global position ``k`` of a run: epoch ``e = k // n`` is a permutation of the ``n``
    samples seeded with ``[seed, e]`` (or the identity without ``shuffle``). Both backends read their batches
    through it, so the same config gives the same samples in the same order on either engine, in every epoch,
    and at any data-parallel size (each rank takes its slice of the positions of a global batch)."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        if n <= 0:
            raise ValueError("the dataset holds no complete sample of train.seq_len + 1 tokens")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._epoch, self._perm = -1, np.arange(n)

    @staticmethod
    def position(step: int, j: int, *, dp_rank: int, per_rank: int, global_batch: int) -> int:
        """The global position of the ``j``-th sample of rank ``dp_rank``'s slice (``per_rank`` samples) of
        step ``step``'s global batch: the one layout both backends read in."""
        return step * global_batch + dp_rank * per_rank + j

    def __getitem__(self, k: int) -> int:
        epoch, i = divmod(k, self.n)
        if self.shuffle and epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return int(self._perm[i])
