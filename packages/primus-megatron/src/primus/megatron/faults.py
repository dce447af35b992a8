"""Test-only fault injectors, read from ``backend.extra.fault_injection`` (never set in a real run).

They make the failures the health checks and the checkpoint code exist for happen for real, inside a
real multi-rank run, so tests can show what the run does about them:

- ``nan_at_step: N``: on step ``N`` (1-based, as metrics name steps) every rank's loss is multiplied
  by NaN inside the loss function, so the reported loss, the backward pass, every gradient and the
  grad norm are NaN, as after a real overflow;
- ``kill_during_save_at_step: N`` (with ``kill_rank``, default 1): while the step-``N`` checkpoint is
  being written, that rank SIGKILLs itself once its shard files are on disk and before the
  checkpoint is committed (all-rank barrier, manifest, rename), as a rank lost mid-save would.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from primus.core.run import faults

log = logging.getLogger("primus.megatron.faults")

KEYS = {"nan_at_step": int, **faults.KEYS}


@dataclass(frozen=True)
class FaultInjection(faults.FaultInjection):
    nan_at_step: int | None = None

    def poison_loss(self, step: int, loss: Any) -> Any:
        if step == self.nan_at_step:
            log.warning("fault injection: NaN loss at step %d", step)
            return loss * float("nan")
        return loss


def issues(extra: dict[str, Any]) -> list[str]:
    """What is wrong with ``backend.extra.fault_injection`` (for validate)."""
    return faults.issues(extra, KEYS)
