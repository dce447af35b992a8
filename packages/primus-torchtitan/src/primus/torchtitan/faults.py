"""Test-only fault injectors, read from ``backend.extra.fault_injection`` (never set in a real run).

- ``kill_during_save_at_step: N`` (with ``kill_rank``, default 1): while the step-``N`` checkpoint is
  being written, that rank SIGKILLs itself once its DCP files are on disk and before the checkpoint is
  committed (all-rank barrier, manifest, rename), as a rank lost mid-save would.

(A NaN loss on a chosen step is injected by the tests' ``drive.py``; see ``tests/test_health.py``.)
This module imports neither torch nor torchtitan (validate uses it).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("primus.torchtitan.faults")

EXTRA_KEY = "fault_injection"  # backend.extra.fault_injection
KEYS = {"kill_during_save_at_step": int, "kill_rank": int}


@dataclass(frozen=True)
class FaultInjection:
    kill_during_save_at_step: int | None = None
    kill_rank: int = 1

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> FaultInjection:
        return cls(**extra.get(EXTRA_KEY, {}))

    def during_save(self, step: int, rank: int) -> None:
        if step == self.kill_during_save_at_step and rank == self.kill_rank:
            log.warning("fault injection: rank %d killed while writing the step-%d checkpoint", rank, step)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)


def issues(extra: dict[str, Any]) -> list[str]:
    """What is wrong with ``backend.extra.fault_injection`` (for validate)."""
    spec = extra.get(EXTRA_KEY, {})
    if not isinstance(spec, dict):
        return ["must be a mapping"]
    out = [f"unknown key {k}" for k in spec if k not in KEYS]
    out += [f"{k} must be an integer" for k, v in spec.items() if k in KEYS and type(v) is not int]
    return out
