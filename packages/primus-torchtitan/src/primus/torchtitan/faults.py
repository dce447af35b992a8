"""Test-only fault injectors, read from ``backend.extra.fault_injection`` (never set in a real run).

- ``kill_during_save_at_step: N`` (with ``kill_rank``, default 1): while the step-``N`` checkpoint is
  being written, that rank SIGKILLs itself once its DCP files are on disk and before the checkpoint is
  committed (all-rank barrier, manifest, rename), as a rank lost mid-save would.

(A NaN loss on a chosen step is injected by the tests' ``drive.py``; see ``tests/test_health.py``.)
This module imports neither torch nor torchtitan (validate uses it).
"""

from primus.core.run.faults import EXTRA_KEY, KEYS, FaultInjection, issues

__all__ = ["EXTRA_KEY", "KEYS", "FaultInjection", "issues"]
