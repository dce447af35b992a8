"""A rank whose engine build fails says why at once and leaves without the teardown barrier: the other ranks may be
blocked in a collective of the build (the optimizer's all-gather) it will never join, and with the barrier the job
hung, silent, until the collective timeout (found with MTP under PP, where only the last stage failed)."""

from __future__ import annotations

import pytest
from megatron_helpers import TINY

from primus.core.launch.resolve import resolve
from primus.megatron import engine as eng


def test_a_rank_whose_build_fails_says_why_and_skips_the_barrier(monkeypatch, caplog):
    left: list[dict] = []
    monkeypatch.setattr(eng, "init_distributed", lambda timeout: (1, 2, "cpu"))
    monkeypatch.setattr(eng, "teardown", lambda **kw: left.append(kw))

    def fails(self, *args):
        raise TypeError("'NoneType' object is not subscriptable")

    monkeypatch.setattr(eng.MegatronEngine, "_build", fails)
    cfg = resolve(TINY, [], world_size=1).config
    with caplog.at_level("ERROR", logger="primus.megatron"), pytest.raises(TypeError):
        eng.MegatronEngine(cfg, None)
    assert left == [{"failed": True}]
    said = [r for r in caplog.records if r.getMessage() == "rank 1: building the megatron engine failed"]
    assert said and said[0].exc_info is not None and "not subscriptable" in str(said[0].exc_info[1])
