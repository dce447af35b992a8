"""Where offline GEMM tuning results are kept when a config does not say.

One file per model and precision: ``$XDG_CACHE_HOME/primus/gemm/<model.name>-<precision>.json``
(``~/.cache`` when ``XDG_CACHE_HOME`` is unset), in the format of :mod:`primus.tune.results`. Beside it:
``<stem>.shapes.json`` (``primus tune gemm record``) and, on ROCm, ``<stem>.tunableop.csv`` (TunableOp's own file).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "primus" / "gemm"


def default_results_file(config: dict[str, Any]) -> Path:
    """The results file for a merged (not yet validated) config; schema defaults fill missing keys."""
    model = (config.get("model") or {}).get("name") or "tiny-llama"
    precision = (config.get("train") or {}).get("precision") or "bf16"
    stem = re.sub(r"[^\w.-]", "_", f"{model}-{precision}")
    return cache_dir() / f"{stem}.json"
