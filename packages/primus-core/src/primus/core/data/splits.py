"""The run's training and evaluation samples, the same on every engine and layout.

With ``data.blend`` the training samples come from several sources by weight (Megatron's ``weight path ...``
meaning): blended sample ``k``'s source is drawn from the weights with a generator seeded by ``train.seed``, and it
takes that source's next sample in a seeded order of its own (cycling when a small source runs out). The blend
holds as many samples as its sources together; :class:`~primus.core.data.packed.GlobalOrder` then orders them.

Training samples are the packed samples of ``data`` (:class:`~primus.core.data.packed.PackedDataset`) less the
held-out ones: with ``eval.holdout`` a fraction of the sample ids, drawn from the seed, is set aside for
evaluation and never trained on. With ``eval.source`` the evaluation samples are packed from those inputs instead
and training keeps every sample. Evaluation reads its samples in order (no shuffle): evaluation batch ``b`` is
samples ``[b·G, (b+1)·G)`` with ``G = train.global_batch_size``, data-parallel rank ``r`` of ``D`` taking the
``r``-th contiguous ``G/D`` of it, as in training (:class:`~primus.core.data.packed.GlobalOrder`).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from primus.core.config.schema import PrimusConfig
from primus.core.data.errors import DataError
from primus.core.data.packed import PackedDataset
from primus.core.data.sources import input_fingerprint, load_token_stream, source_inputs

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


_BLEND_STREAM = 0x424C4E  # "BLN"


class Blend:
    """Samples of ``datasets`` interleaved by ``weights`` (normalised), reproducibly from ``seed``.

    ``source[k]`` and ``index[k]`` (int32 / int64 arrays of the blend's length) say which sample of which
    source blended sample ``k`` is: ``len × 12`` bytes in memory."""

    def __init__(self, datasets: list[Any], weights: list[float], seed: int) -> None:
        self.datasets = datasets
        n = sum(len(d) for d in datasets)
        p = np.asarray(weights, dtype=np.float64)
        rng = np.random.default_rng([seed, _BLEND_STREAM])
        self.source = rng.choice(len(datasets), size=n, p=p / p.sum()).astype(np.int32)
        self.index = np.empty(n, dtype=np.int64)
        for i, d in enumerate(datasets):
            at = np.flatnonzero(self.source == i)  # the blend positions drawn from source i, in order
            order = np.random.default_rng([seed, _BLEND_STREAM, i]).permutation(len(d))
            self.index[at] = order[np.arange(len(at)) % len(d)]

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, k: int) -> Any:
        return self.datasets[int(self.source[k])][int(self.index[k])]


def blend_configs(cfg: PrimusConfig) -> list[tuple[Any, str, str]]:
    """(data section, its source's key, its paths' key) of each training source: ``data`` itself, or one per
    ``data.blend`` entry (that entry's path as the source)."""
    if not cfg.data.blend:
        return [(cfg.data, "data.source", "data.paths")]
    return [
        (cfg.data.model_copy(update={"source": b.path, "paths": []}), f"data.blend[{i}].path", "data.paths")
        for i, b in enumerate(cfg.data.blend)
    ]


def eval_source(cfg: PrimusConfig) -> Any:
    """The data section of ``eval.source`` / ``eval.paths`` (read like ``data``), None without an eval.source."""
    e = cfg.eval
    return None if e.source is None else cfg.data.model_copy(update={"source": e.source, "paths": list(e.paths)})


def holdout_ids(n: int, fraction: float, seed: int) -> np.ndarray:
    """The sorted ids of the ``ceil(fraction × n)`` samples held out of ``n``, drawn from ``seed``."""
    count = math.ceil(fraction * n)
    perm = np.random.default_rng([seed, _HOLDOUT_STREAM]).permutation(n)
    return np.sort(perm[:count])


def _packed(cfg: PrimusConfig, data: Any, tokenizer: Any) -> Any:
    if cfg.train.objective == "sft":  # records with a trainable mask (primus.core.data.sft)
        from primus.core.data.sft import sft_dataset
        from primus.core.data.sources import text_tokenizer

        return sft_dataset(data, text_tokenizer(data, tokenizer, cfg.model.vocab_size), cfg.train.seq_len)
    tokens = load_token_stream(data, tokenizer, cfg.model.vocab_size, cfg.train.seed)
    return PackedDataset(tokens, cfg.train.seq_len)


# The last training samples built in this process (keyed by the data config and its files' sizes and times): a run
# builds them for its training and again for its held-out evaluation; fine-tuning records are encoded in memory (no
# disk cache), so the second build would encode them again.
_built: dict[str, Any] = {}


def _all_training(cfg: PrimusConfig, tokenizer: Any) -> Any:
    """The packed samples of ``data``, or the blend of ``data.blend``'s sources (before any holdout)."""
    t = cfg.train
    files = [input_fingerprint(item) for data, _, _ in blend_configs(cfg) for item in source_inputs(data)]
    key = json.dumps([cfg.data.model_dump(mode="json"), files, t.seq_len, t.seed, t.objective, cfg.model.vocab_size])
    if key not in _built:
        _built.clear()
        _built[key] = _build_training(cfg, tokenizer)
    return _built[key]


def _build_training(cfg: PrimusConfig, tokenizer: Any) -> Any:
    if not cfg.data.blend:
        return _packed(cfg, cfg.data, tokenizer)
    parts = []
    for data, key, _ in blend_configs(cfg):
        parts.append(_packed(cfg, data, tokenizer))
        if not len(parts[-1]):
            raise DataError(f"{key}: holds no complete sample of train.seq_len + 1 tokens")
    return Blend(parts, [b.weight for b in cfg.data.blend], cfg.train.seed)


def training_samples(cfg: PrimusConfig, tokenizer: Any = None) -> Any:
    """What training reads: every packed sample of ``data`` but the held-out ones (``tokenizer`` None: the data
    layer loads ``data.tokenizer`` where the source needs one)."""
    packed = _all_training(cfg, tokenizer)
    if not cfg.eval.holdout:
        return packed
    held = holdout_ids(len(packed), cfg.eval.holdout, cfg.train.seed)
    return Subset(packed, np.setdiff1d(np.arange(len(packed)), held, assume_unique=True))


def eval_samples(cfg: PrimusConfig, tokenizer: Any = None) -> Any:
    """What evaluation reads (None when the config names no evaluation data); refuses, naming the keys, a set
    smaller than ``eval.batches`` global batches."""
    e = cfg.eval
    if e.source is not None:
        samples: Any = _packed(cfg, eval_source(cfg), tokenizer)
        where = f"eval.source {e.source!r} holds"
    elif e.holdout:
        packed = _all_training(cfg, tokenizer)
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
