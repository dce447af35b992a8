"""A torchtitan data loader over Primus's data layer (``primus.core.data``).

Every layout sees the same global batches, split the same way: the global sample order is fixed by the
seed (a permutation per epoch), global batch ``s`` is positions ``[s*G, (s+1)*G)`` of that order, and
data-parallel rank ``r`` of ``dp`` takes the contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of it, in
batches of torchtitan's ``local_batch_size``. So the loss of a step is the mean over the same tokens
whatever the layout, and a resumed run continues with exactly the samples a straight run would see.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from primus.core.config.schema import PrimusConfig
from primus.core.data import GlobalOrder
from primus.torchtitan import compat

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402


class PrimusDataLoader(BaseDataLoader):
    """Yields ``({"input": tokens}, labels)`` batches of int64 ``[batch, seq_len]`` forever; samples that carry their
    positions' documents (``data.sft_packing: packed``) add them as ``"documents"`` (the trainer takes them out).

    State (saved by torchtitan's checkpointer) is the number of samples the whole run has consumed, the
    same on every rank (a checkpoint is taken between steps, when every rank has consumed ``steps ×
    G/dp``). So a run resumed with another data-parallel size continues at the same global position:
    rank ``r`` of the new ``dp`` starts at its slice of the next global batch, no sample repeated or
    skipped.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        dp_rank: int,
        dp_world_size: int,
        batch_size: int,
        global_batch_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if global_batch_size % dp_world_size or (global_batch_size // dp_world_size) % batch_size:
            raise ValueError(
                f"global batch {global_batch_size} does not split into {dp_world_size} ranks × batches of {batch_size}"
            )
        self.dataset, self.dp_rank, self.dp_world_size = dataset, dp_rank, dp_world_size
        self.batch_size, self.global_batch_size = batch_size, global_batch_size
        self.local_batch = global_batch_size // dp_world_size
        self.order = GlobalOrder(len(dataset), seed, shuffle)
        self.consumed = 0  # samples of this rank already yielded

    def position(self, local_index: int) -> int:
        step, j = divmod(local_index, self.local_batch)
        return GlobalOrder.position(
            step, j, dp_rank=self.dp_rank, per_rank=self.local_batch, global_batch=self.global_batch_size
        )

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            rows = [self.dataset[self.order[self.position(self.consumed + i)]] for i in range(self.batch_size)]
            self.consumed += self.batch_size
            inputs = torch.from_numpy(np.stack([r[0] for r in rows]))
            labels = torch.from_numpy(np.stack([r[1] for r in rows]))
            carried = {"documents": torch.from_numpy(np.stack([r[2] for r in rows]))} if len(rows[0]) > 2 else {}
            yield {"input": inputs, **carried}, labels

    def state_dict(self) -> dict[str, Any]:
        steps, partial = divmod(self.consumed, self.local_batch)
        assert not partial, "the data loader is saved between steps"
        return {"samples_consumed": steps * self.global_batch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        samples = int(state_dict["samples_consumed"])
        steps, rest = divmod(samples, self.global_batch_size)
        if rest:  # a user's change (a checkpoint without a data fingerprint: core's check did not see it): exit 2
            from primus.core.run.checkpoints import CheckpointMismatch

            raise CheckpointMismatch(
                f"the checkpoint's run consumed {samples} samples, not a whole number of global batches of "
                f"{self.global_batch_size} (train.global_batch_size changed): cannot continue the data order"
            )
        self.consumed = steps * self.local_batch


def load_dataset(cfg: PrimusConfig) -> Any:
    """Core's training samples (packed, less any ``eval.holdout``; tokenized once, cached on disk by
    primus.core.data): the same on both engines."""
    from primus.core.data.splits import training_samples

    return training_samples(cfg)


def dataloader_builder(cfg: PrimusConfig):
    """A TrainSpec ``build_dataloader_fn`` for this config (torchtitan passes the dp rank and size)."""

    def build(dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any, **_: Any) -> PrimusDataLoader:
        return PrimusDataLoader(
            load_dataset(cfg),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=job_config.training.local_batch_size,
            global_batch_size=int(cfg.train.global_batch_size or 0),
            seed=cfg.train.seed,
        )

    return build
