"""Test-only fault injectors, read from ``backend.extra.fault_injection`` (never set in a real run).

- ``kill_during_save_at_step: N`` (with ``kill_rank``, default 1): while the step-``N`` checkpoint is
  being written, that rank SIGKILLs itself once its DCP files are on disk and before the checkpoint is
  committed (all-rank barrier, manifest, rename), as a rank lost mid-save would.

(A NaN loss on a chosen step is injected by the tests' ``drive.py``; see ``tests/test_health.py``.)
This module imports neither torch nor torchtitan (validate uses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from primus.core import faults
from primus.core.faults import EXTRA_KEY, KEYS, issues

__all__ = ["EXTRA_KEY", "KEYS", "FaultInjection", "issues"]


@dataclass(frozen=True)
class FaultInjection:
    kill_during_save_at_step: int | None = None
    kill_rank: int = 1

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> FaultInjection:
        return cls(**extra.get(EXTRA_KEY, {}))

    def during_save(self, step: int, rank: int) -> None:
        faults.kill_during_save(step, rank, self.kill_during_save_at_step, self.kill_rank)
