"""A default CPU run's console: one line per event, none of torchtitan's start-up narration or GPU-only lookups
(lspci, peak FLOPs, the model args as JSON, CPU autocast warnings, the purge thread), a first line naming the run."""

from __future__ import annotations

import logging

import pytest
from conftest import primus_train

from primus.torchtitan import quiet

NOISE = ("lspci", "Peak flops", "Peak FLOPS", "fallback to A100", "Building primus_llama3", '"_enforced"',
         "autocast", "purge thread", "[GC]", "Building device mesh", "Trainer is initialized")  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return primus_train("tiny-demo", tmp_path_factory.mktemp("console"), "train.steps=6", "logging.tensorboard=false")


def test_a_default_run_says_each_thing_once(run):
    lines = (run.stdout + run.stderr).splitlines()
    assert lines[0].startswith("train tiny-demo: tiny-llama on torchtitan, 1 process, 6 steps -> ")
    assert [n for n in NOISE if any(n in line for line in lines)] == []
    assert sum("torchtitan kernels:" in line for line in lines) == 1  # one line for every op
    assert sum(line.startswith("step ") for line in lines) == 2  # logging.interval 5: steps 5 and 6
    assert lines[-1].startswith("done: ")
    assert len(lines) <= 20, "\n".join(lines)  # 75 before torchtitan's narration was filtered


def _record(msg: str, level: int, in_torchtitan: bool) -> logging.LogRecord:
    path = f"{quiet.TORCHTITAN_DIR}/trainer.py" if in_torchtitan else "/elsewhere/x.py"
    return logging.LogRecord("root", level, path, 1, msg, (), None)


def test_the_filter_keeps_torchtitans_warnings_and_debug_narration():
    quiet_, debug = quiet.TorchtitanNoise(debug=False), quiet.TorchtitanNoise(debug=True)
    narration = _record("Building primus_llama3 primus with {...}", logging.INFO, True)
    assert not quiet_.filter(narration) and debug.filter(narration)
    assert quiet_.filter(_record("a real torchtitan warning", logging.WARNING, True))
    peak = _record("Peak flops undefined for: cpu, fallback to A100", logging.WARNING, True)
    assert not quiet_.filter(peak) and not debug.filter(peak)
    assert quiet_.filter(_record("Building device mesh", logging.INFO, False))  # not torchtitan's: kept
