"""Training samples and the global batch order.

Two sources: Primus's own (``primus.core.data``: bundled corpus, mock tokens, .jsonl/.txt/.parquet
files, packed to ``seq_len``, blended by core's ``data.blend``), and Megatron indexed datasets
(``data.format: megatron``, .bin/.idx prefixes) through megatron-core's ``BlendedMegatronDatasetBuilder`` and
``GPTDataset`` (a ``data.blend`` then by megatron's own ``BlendedDataset``).

Batches are laid out so every parallel layout sees the same tokens: the global sample order is
fixed by the seed, global batch ``k`` is samples ``[k·G, (k+1)·G)`` of that order, and data-parallel
rank ``r`` of ``D`` takes the ``r``-th contiguous ``G/D`` of it, cut into micro-batches. So a step's
loss averaged over the global batch is the same computation at any DP size. The position in the
data is the step number; nothing else needs saving to resume.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from primus.core.config.schema import PrimusConfig
from primus.core.data import GlobalOrder


class Batches:
    """This rank's micro-batches of each step: ``micro_batches(step)`` -> [(tokens, labels)], each
    LongTensor [micro_batch_size, seq_len] on ``device``; samples that carry their positions' documents
    (``data.sft_packing: packed``) add them: (tokens, labels, documents)."""

    def __init__(self, dataset: Any, cfg: PrimusConfig, dp_rank: int, dp_size: int, device: Any, shuffle: bool = True):
        t = cfg.train
        self.ds, self.device = dataset, device
        self.gbs, self.mbs = int(t.global_batch_size), t.micro_batch_size
        self.per_rank = self.gbs // dp_size
        self.num_micro = self.per_rank // self.mbs
        self.dp_rank = dp_rank
        self.order = GlobalOrder(len(dataset), t.seed, shuffle)

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        positions = [  # this rank's slice of the step's global batch
            GlobalOrder.position(step, j, dp_rank=self.dp_rank, per_rank=self.per_rank, global_batch=self.gbs)
            for j in range(self.per_rank)
        ]
        out = []
        for m in range(self.num_micro):
            items = [self.ds[self.order[k]] for k in positions[m * self.mbs : (m + 1) * self.mbs]]
            tokens = torch.from_numpy(np.stack([np.asarray(x[0]) for x in items]).astype(np.int64))
            labels = torch.from_numpy(np.stack([np.asarray(x[1]) for x in items]).astype(np.int64))
            carried = [torch.from_numpy(np.stack([x[2] for x in items]))] if len(items[0]) > 2 else []
            out.append(tuple(t.to(self.device) for t in (tokens, labels, *carried)))
        return out


class _MegatronSamples:
    """GPTDataset items as (inputs, labels) pairs."""

    def __init__(self, ds: Any):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        item = self.ds[i]
        return item["tokens"].numpy(), item["labels"].numpy()


def _prefixes(path_str: str) -> list[str]:
    path = Path(path_str)
    if path.is_dir():
        return sorted(str(x.with_suffix("")) for x in path.glob("*.idx"))
    return [str(path.with_suffix("")) if path.suffix in (".bin", ".idx") else str(path)]


def _megatron_blend(cfg: PrimusConfig) -> tuple[list[str], list[float] | None]:
    """megatron-core's blend: (prefixes, weights); with ``data.blend`` each entry's weight (a folder's shared evenly
    by its prefixes), drawn by megatron's own BlendedDataset."""
    if not cfg.data.blend:
        return [p for src in [cfg.data.source, *cfg.data.paths] for p in _prefixes(src)], None
    prefixes, weights = [], []
    for entry in cfg.data.blend:
        found = _prefixes(entry.path)
        prefixes += found
        weights += [entry.weight / len(found)] * len(found)
    return prefixes, weights


def megatron_dataset(cfg: PrimusConfig, cache_dir: Path) -> _MegatronSamples:
    """megatron-core's GPTDataset over .bin/.idx prefixes, sized for the whole run."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from primus.core.data import eos_id, load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer)
    # GPTDataset reads only these of a tokenizer (eod for document ends; the identifiers name the
    # index cache), so a namespace stands in for a megatron tokenizer class.
    shim = SimpleNamespace(
        vocab_size=cfg.model.vocab_size,
        eod=eos_id(tok),
        pad=-1,
        unique_identifiers={"class": "primus", "tokenizer": cfg.data.tokenizer},
    )
    num_samples = int(cfg.train.global_batch_size) * cfg.train.steps
    config = GPTDatasetConfig(
        random_seed=cfg.train.seed,
        sequence_length=cfg.train.seq_len,
        blend=_megatron_blend(cfg),
        split="100,0,0",
        path_to_cache=str(cache_dir),
        tokenizer=shim,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config).build()
    return _MegatronSamples(train)


def primus_dataset(cfg: PrimusConfig) -> Any:
    """Core's training samples (packed, less any ``eval.holdout``): the same on both engines."""
    from primus.core.data.splits import training_samples

    return training_samples(cfg)


def build_batches(cfg: PrimusConfig, dp_rank: int, dp_size: int, device: Any, cache_dir: Path) -> Batches:
    if cfg.data.format == "megatron":
        # GPTDataset already shuffles with the seed; its order is the global order.
        return Batches(megatron_dataset(cfg, cache_dir), cfg, dp_rank, dp_size, device, shuffle=False)
    return Batches(primus_dataset(cfg), cfg, dp_rank, dp_size, device)
