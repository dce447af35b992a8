"""A default 6-step run of tiny-demo-megatron on 2 ranks: one line per event from rank 0 (core's rank-0 policy:
the other ranks warn only), none of the warnings every rank printed about what megatron-core itself calls."""

from __future__ import annotations

from megatron_helpers import primus

from primus.megatron.dist import ENGINE_WARNINGS


def test_two_ranks_say_each_thing_once(tmp_path):
    proc = primus("train", "tiny-demo-megatron", tmp_path / "run", 2, "train.steps=6", "logging.tensorboard=false")
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    assert lines[0].startswith("train tiny-demo-megatron: tiny-llama on megatron, 2 processes, 6 steps -> ")
    assert [line for line in lines if "[rank1]" in line] == []  # rank 1's INFO lines (2 before the policy)
    assert [w for w in (*ENGINE_WARNINGS, "Warning", "warn(") if any(w in line for line in lines)] == []
    assert sum(line.startswith("step ") for line in lines) == 2 and lines[-1].startswith("done: ")
    assert len(lines) <= 10, "\n".join(lines)  # 23 before (12 of them the engine's warnings, 6 a rank)
