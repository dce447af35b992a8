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
