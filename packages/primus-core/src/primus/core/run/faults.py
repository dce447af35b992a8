"""Test-only fault injection shared by the backends, read from ``backend.extra.fault_injection`` (never set
in a real run): failures the checkpoint code exists for, made to happen inside a real multi-rank run.

- ``kill_during_save_at_step: N`` (with ``kill_rank``, default 1): while the step-``N`` checkpoint is being
  written, that rank SIGKILLs itself once its files are on disk and before the checkpoint is committed
  (all-rank barrier, manifest, rename), as a rank lost mid-save would.
- ``oom_at_step: N`` (with ``oom_rank``, default every rank): step ``N`` raises torch's ``OutOfMemoryError`` on that
  rank as its engine's step would, the other ranks left waiting in the step's collectives.

A backend may accept more keys (megatron: ``nan_at_step``); it passes them to :func:`issues`. No torch import.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, fields
from typing import Any, Self

log = logging.getLogger("primus.faults")

EXTRA_KEY = "fault_injection"  # backend.extra.fault_injection
KEYS = {"kill_during_save_at_step": int, "kill_rank": int, "oom_at_step": int, "oom_rank": int}


def kill_during_save(step: int, rank: int, at_step: int | None, kill_rank: int) -> None:
    """SIGKILL this process if it is ``kill_rank`` writing the ``at_step`` checkpoint."""
    if step == at_step and rank == kill_rank:
        log.warning("fault injection: rank %d killed while writing the step-%d checkpoint", rank, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class FaultInjection:
    """The injectors of one run, from ``backend.extra`` (a backend with more keys subclasses this)."""

    kill_during_save_at_step: int | None = None
    kill_rank: int = 1
    oom_at_step: int | None = None
    oom_rank: int | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> Self:
        """This class's injectors from ``backend.extra`` (keys of a backend's subclass are left to it)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in extra.get(EXTRA_KEY, {}).items() if k in names})

    def during_save(self, step: int, rank: int) -> None:
        kill_during_save(step, rank, self.kill_during_save_at_step, self.kill_rank)

    def out_of_memory(self, step: int, rank: int) -> None:
        if step == self.oom_at_step and self.oom_rank in (None, rank):
            import torch

            log.warning("fault injection: out of memory at step %d on rank %d", step, rank)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fault injection)")


def issues(extra: dict[str, Any], keys: dict[str, type] = KEYS) -> list[str]:
    """What is wrong with ``backend.extra.fault_injection`` given the ``keys`` a backend accepts."""
    spec = extra.get(EXTRA_KEY, {})
    if not isinstance(spec, dict):
        return ["must be a mapping"]
    out = [f"unknown key {k}" for k in spec if k not in keys]
    out += [f"{k} must be an integer" for k, v in spec.items() if k in keys and type(v) is not int]
    return out
