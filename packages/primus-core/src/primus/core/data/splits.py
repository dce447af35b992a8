"""The run's training and evaluation samples, the same on every engine and layout.

Training samples are the packed samples of ``data`` (:class:`~primus.core.data.packed.PackedDataset`) less the
held-out ones: with ``eval.holdout`` a fraction of the sample ids, drawn from the seed, is set aside for
evaluation and never trained on. With ``eval.source`` the evaluation samples are packed from those inputs instead
and training keeps every sample. Evaluation reads its samples in order (no shuffle): evaluation batch ``b`` is
samples ``[b·G, (b+1)·G)`` with ``G = train.global_batch_size``, data-parallel rank ``r`` of ``D`` taking the
``r``-th contiguous ``G/D`` of it, as in training (:class:`~primus.core.data.packed.GlobalOrder`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from primus.core.config.schema import PrimusConfig
from primus.core.data.errors import DataError
from primus.core.data.packed import PackedDataset
from primus.core.data.sources import load_token_stream

# mixed into the seed so that the held-out draw is independent of the training order drawn from the same seed
_HOLDOUT_STREAM = 0x45564C  # "EVL"


class Subset:
    """Samples ``ids`` of ``dataset``, renumbered 0..len-1."""

    def __init__(self, dataset: Any, ids: np.ndarray) -> None:
        self.dataset, self.ids = dataset, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(self.ids[index])]


def holdout_ids(n: int, fraction: float, seed: int) -> np.ndarray:
    """The sorted ids of the ``ceil(fraction × n)`` samples held out of ``n``, drawn from ``seed``."""
    count = math.ceil(fraction * n)
    perm = np.random.default_rng([seed, _HOLDOUT_STREAM]).permutation(n)
    return np.sort(perm[:count])


def _packed(cfg: PrimusConfig, data: Any, tokenizer: Any) -> PackedDataset:
    tokens = load_token_stream(data, tokenizer, cfg.model.vocab_size, cfg.train.seed)
    return PackedDataset(tokens, cfg.train.seq_len)


def training_samples(cfg: PrimusConfig, tokenizer: Any = None) -> Any:
    """What training reads: every packed sample of ``data`` but the held-out ones (``tokenizer`` None: the data
    layer loads ``data.tokenizer`` where the source needs one)."""
    packed = _packed(cfg, cfg.data, tokenizer)
    if not cfg.eval.holdout:
        return packed
    held = holdout_ids(len(packed), cfg.eval.holdout, cfg.train.seed)
    return Subset(packed, np.setdiff1d(np.arange(len(packed)), held, assume_unique=True))


def eval_samples(cfg: PrimusConfig, tokenizer: Any = None) -> Any:
    """What evaluation reads (None when the config names no evaluation data); refuses, naming the keys, a set
    smaller than ``eval.batches`` global batches."""
    e = cfg.eval
    if e.source is not None:
        data = cfg.data.model_copy(update={"source": e.source, "paths": list(e.paths)})
        samples: Any = _packed(cfg, data, tokenizer)
        where = f"eval.source {e.source!r} holds"
    elif e.holdout:
        packed = _packed(cfg, cfg.data, tokenizer)
        samples = Subset(packed, holdout_ids(len(packed), e.holdout, cfg.train.seed))
        where = f"eval.holdout {e.holdout} of the {len(packed)} training samples is"
    else:
        return None
    need = e.batches * int(cfg.train.global_batch_size or 0)
    if len(samples) < need:
        raise DataError(
            f"eval.batches {e.batches} × train.global_batch_size {cfg.train.global_batch_size} needs {need} samples "
            f"of train.seq_len + 1 tokens; {where} {len(samples)}: lower eval.batches or give more evaluation data"
        )
    return samples
