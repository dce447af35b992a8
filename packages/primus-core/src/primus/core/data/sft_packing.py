"""Fine-tuning samples of whole chats (``data.sft_packing``: ``padded`` or ``packed``; ``stream`` is
:class:`~primus.core.data.sft.SFTDataset`).

A chat of ``n`` tokens takes ``n - 1`` positions of a sample: its tokens but the last as inputs, its tokens but the
first as labels (:data:`~primus.core.data.labels.IGNORE_INDEX` where the token is context), as ``transformers``'
shifted loss over the chat alone. A chat longer than ``seq_len + 1`` tokens keeps its first ``seq_len + 1`` (as
TRL's ``max_length`` truncates; the count is logged).

- ``padded``: sample ``i`` is chat ``i``, then padding;
- ``packed``: whole chats, first-fit in data order (each chat goes into the first sample with room for it, a new one
  if none has: deterministic, and a sample's chats keep their data order), then padding.

Padding is the EOS token with an ignored label. With ``documents`` each sample also carries its positions' chat ids
(``[seq_len]`` int32: 0, 1, ... per chat, the padding one more), which the engines hand to the attention as its
documents (:mod:`primus.core.kernels.documents`): each chat attends only to itself, and the padding to itself. A
padded sample needs no mask (causal attention never reads the padding after a chat's tokens).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from primus.core.data.labels import IGNORE_INDEX

log = logging.getLogger("primus.data")

MODES = ("padded", "packed")


def first_fit(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of item indices: each item in order into the first bin whose free room holds its size (every size at most
    ``capacity``), a new bin if none. A max tree over the bins' free room finds that bin in ``O(log n)``."""
    n = len(sizes)
    if n and int(sizes.max()) > capacity:
        raise ValueError(f"an item of size {int(sizes.max())} does not fit a bin of {capacity}")
    leaves = 1 << max(n - 1, 0).bit_length()
    room = [capacity] * (2 * leaves)  # unopened bins are empty: the leftmost is the next new one
    bins: list[list[int]] = []
    for i, size in enumerate(sizes.tolist()):
        node = 1
        while node < leaves:  # the leftmost leaf with room: down to the left child when it has room
            node = 2 * node if room[2 * node] >= size else 2 * node + 1
        b = node - leaves
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        room[node] -= size
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


class ChatSamples:
    """Samples of whole chats: ``(inputs, labels)`` int64 ``[seq_len]``, and with ``documents`` each position's
    chat id (int32). ``tokens`` / ``trainable`` are the records' stream and mask, ``lengths`` each record's token
    count (:func:`~primus.core.data.sft.encode_records`); ``pad`` the padding token."""

    def __init__(
        self,
        tokens: np.ndarray,
        trainable: np.ndarray,
        lengths: np.ndarray,
        seq_len: int,
        mode: str,
        *,
        pad: int,
        documents: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"data.sft_packing {mode!r}: one of {', '.join(MODES)} lays out whole chats")
        self.tokens, self.trainable, self.seq_len, self.pad = tokens, trainable, seq_len, pad
        self.documents = documents
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        # positions each chat takes (its tokens but the last), at most seq_len: longer chats are truncated
        self.sizes = np.minimum(np.maximum(lengths - 1, 0), seq_len)
        self.truncated = int((lengths - 1 > seq_len).sum())
        keep = np.flatnonzero(self.sizes > 0)  # a one-token record has no label to train on
        if mode == "padded":
            self.bins = [[int(i)] for i in keep]
        else:
            self.bins = [[int(keep[j]) for j in b] for b in first_fit(self.sizes[keep], seq_len)]
        if int(os.environ.get("RANK", "0")) == 0:
            filled = self.sizes.sum() / max(len(self.bins) * seq_len, 1)
            log.info(
                "data.sft_packing %s: %d chats in %d samples of %d positions (%.1f%% chat tokens, the rest padding)",
                mode,
                len(keep),
                len(self.bins),
                seq_len,
                100 * filled,
            )
            if self.truncated:
                log.warning(
                    "data.sft_packing %s: %d of %d chats are longer than train.seq_len + 1 (%d) tokens: truncated",
                    mode,
                    self.truncated,
                    len(lengths),
                    seq_len + 1,
                )

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> tuple[np.ndarray, ...]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        chats = self.bins[index]
        s = self.seq_len
        inputs = np.full(s, self.pad, dtype=np.int64)
        labels = np.full(s, IGNORE_INDEX, dtype=np.int64)
        documents = np.full(s, len(chats), dtype=np.int32)  # the padding: a document of its own
        at = 0
        for doc, c in enumerate(chats):
            start, n = int(self.starts[c]), int(self.sizes[c])
            inputs[at : at + n] = self.tokens[start : start + n]
            window = slice(start + 1, start + n + 1)
            labels[at : at + n] = np.where(self.trainable[window], self.tokens[window], IGNORE_INDEX)
            documents[at : at + n] = doc
            at += n
        return (inputs, labels, documents) if self.documents else (inputs, labels)
