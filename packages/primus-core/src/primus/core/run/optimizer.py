"""Which parameters the optimizer decays: one rule for every engine, so that one recipe is one run on each.

Weight decay applies to matrices (linear and embedding weights, stacked experts); norm weights and biases, the 1-D
parameters, take none: Megatron-Core's default (``wd_mult`` 0 for 1-D parameters and biases), which megatron's
backend hands its optimizer as an override and TorchTitan's (one decayed group) is split by.
"""

from __future__ import annotations

from typing import Any


def takes_weight_decay(param: Any) -> bool:
    """Whether ``param`` (a tensor) is decayed: it has two or more dimensions."""
    return param.ndim >= 2


def split_weight_decay(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``param_groups`` (a torch optimizer's) with each group split in two: the parameters :func:`takes_weight_decay`
    keeps with the group's weight decay, then the others at weight decay 0 (empty groups left out). Before any
    optimizer state exists."""
    groups = []
    for group in param_groups:
        decayed = [p for p in group["params"] if takes_weight_decay(p)]
        flat = [p for p in group["params"] if not takes_weight_decay(p)]
        groups += [dict(group, params=decayed)] if decayed else []
        groups += [dict(group, params=flat, weight_decay=0.0)] if flat else []
    return groups
