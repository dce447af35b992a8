"""The planner's step time against our own H200 runs: the ``ours`` rows of benchmarks/planner_vs_published.py (dense
Llama 3.2 1B / 3B on both engines; Qwen3-30B-A3B's shape at micro-batch 1 and 2 on both, Mixtral's on Megatron),
each predicted with its engine's installed planner profile, within 10% of the measured tokens/s."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import planner_vs_published as table  # noqa: E402

OURS = [r for r in table.ROWS if r.source == "ours"]


@pytest.fixture(scope="module")
def registry():
    from primus.core.contracts.plugins import get_registry

    return get_registry()


def test_the_table_holds_dense_and_moe_runs_of_both_engines():
    runs = {(r.engine, r.preset, r.micro_batch) for r in OURS}
    for engine in ("megatron", "torchtitan"):
        assert {(engine, "llama3.2-1b", 1), (engine, "qwen3-30b-a3b", 1), (engine, "qwen3-30b-a3b", 2)} <= runs
    assert ("megatron", "mixtral-8x7b", 1) in runs


@pytest.mark.parametrize("row", OURS, ids=lambda r: f"{r.engine}-{r.preset}-mbs{r.micro_batch}")
def test_predicted_step_time_is_within_10_percent_of_the_measured(row, registry):
    got = table.predict(row, registry)["predicted_over_published"]
    assert got == pytest.approx(1.0, abs=0.10), got
