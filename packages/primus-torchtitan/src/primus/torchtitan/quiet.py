"""What torchtitan prints that a Primus run does not need, filtered where it is emitted.

torchtitan logs to the root logger from its own modules: its start-up narration (the model args as JSON, device
capacity, mesh building, GC and purge-thread lines) is core's business here and shows at ``logging.level: debug``
only; its peak-FLOPs lookup (``lspci`` errors, "Peak flops undefined ... fallback to A100", the MFU denominator)
feeds a metrics processor Primus keeps silent (core computes MFU, and reports none on a CPU), so it never shows.
On a CPU, torchtitan's fp32 autocast context warns that CPU autocast takes no fp32 (it then does nothing), DTensor
warns that its random ops may not support a CPU mesh (Primus draws the initial weights itself), and torchtitan
says which NCCL settings it overrides (gloo reads none).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import warnings
from pathlib import Path

# found, not imported: torchtitan picks its device at import (primus.torchtitan.compat does that import)
TORCHTITAN_DIR = str(Path(importlib.util.find_spec("torchtitan").origin).parent)
# from torchtitan's peak-FLOPs lookup (torchtitan.tools.utils.get_peak_flops) and its caller
NEVER = ("Error running lspci", "Peak flops undefined", "Peak FLOPS used for computing MFU")
# on a CPU (gloo): NCCL settings it overrides, which no CPU run reads
CPU_ONLY = ("ENV[TORCH_NCCL",)
# DTensor's random ops on a CPU mesh: Primus seeds every tensor itself (train.init: canonical)
CPU_WARNINGS = (
    "In CPU autocast, but the target dtype is not supported",
    "DTensor random operators may not have complete support",
    "DTensor manual_seed() may not have complete support",
)


class TorchtitanNoise(logging.Filter):
    def __init__(self, debug: bool, cpu: bool = False) -> None:
        super().__init__()
        self.debug, self.never = debug, NEVER + (CPU_ONLY if cpu else ())

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.pathname.startswith(TORCHTITAN_DIR):
            return True
        if any(str(record.msg).startswith(text) for text in self.never):
            return False
        return self.debug or record.levelno >= logging.WARNING


def install(level: str, device: str) -> None:
    """Filter torchtitan's records on the root logger (where it logs); idempotent."""
    root = logging.getLogger()
    for f in [f for f in root.filters if isinstance(f, TorchtitanNoise)]:
        root.removeFilter(f)
    root.addFilter(TorchtitanNoise(debug=level == "debug", cpu=device == "cpu"))
    if device == "cpu":
        for text in CPU_WARNINGS:
            warnings.filterwarnings("ignore", message=re.escape(text))
