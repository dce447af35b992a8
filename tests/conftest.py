"""The cross-package tests' order, for pytest-xdist (nox: 2 workers, ``--dist loadfile``: each file whole on one
worker, the files handed out in collection order, xdist's own reordering turned off here).

Left to itself xdist hands out the files with the most tests first; those whose module fixtures train for minutes
hold 1-3 tests (the GPU suite's smoke, 3), so one of them could start last while the other worker had nothing left.
Here the slowest go first, and the rest follow as xdist would have ordered them (most tests first).
"""

from __future__ import annotations

# Slowest first (CPU time of each file's tests and fixtures, measured on a 2-core machine with 2 workers)
SLOWEST_FIRST = [
    "test_deepseek_engines.py",
    "test_gpu_suite.py",
    "test_same_run.py",
    "test_lora_same_run.py",
    "test_hf_training.py",
    "test_lora_export.py",
    "test_preemption.py",
    "test_eval_then_save.py",
    "test_hf_roundtrip.py",
    "test_faults_2rank.py",
    "test_hf_sharded.py",
    "test_document_mask.py",
    "test_moe_balancing_same_run.py",
    "test_hf_folders.py",
    "test_sft.py",
]


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's: files by their number of tests
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    first = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: (first.get(item.path.name, len(first)), -counts[item.path.name], item.path.name))
