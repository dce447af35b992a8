"""The learning-rate schedule of every run, whatever the engine: linear warmup from zero, then cosine or linear
decay to ``min_lr`` (or constant), over ``train.schedule.decay_steps`` (default ``train.steps``).

Step ``n`` is the ``n``-th *applied* update (1-based): a step whose update the health check skipped does not
advance it. The arithmetic is Megatron-Core's ``OptimizerParamScheduler.get_lr`` (init_lr 0, decay over
``max(decay_steps, warmup + 1)`` steps), operation for operation, so a Megatron run keeps its learning rates to the
last bit; every engine's adapter sets the value core hands it on its optimizer.

    n <= warmup:   lr = max_lr · n / warmup
    constant:      lr = max_lr
    n > decay:     lr = min_lr
    otherwise:     r = (n - warmup) / (decay - warmup);  lr = min_lr + c(r) · (max_lr - min_lr)
                   c(r) = ½ (cos πr + 1) (cosine)  |  1 - r (linear)
"""

from __future__ import annotations

import math

from primus.core.config.schema import TrainConfig


def lr_at(n: int, train: TrainConfig) -> float:
    """The learning rate of the ``n``-th applied update (1-based)."""
    o, s = train.optimizer, train.schedule
    max_lr = o.lr
    min_lr = o.min_lr if s.decay != "constant" else o.lr
    warmup = s.warmup_steps
    decay_steps = max(s.decay_steps or train.steps, warmup + 1)
    if warmup > 0 and n <= warmup:
        return 0.0 + ((max_lr - 0.0) * float(n) / float(warmup))
    if s.decay == "constant":
        return max_lr
    if n > decay_steps:
        return min_lr
    ratio = float(n - warmup) / float(decay_steps - warmup)
    coeff = 1.0 - ratio if s.decay == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)
