"""``primus train`` holds the planner's band before anything is built (``primus.core.planner.auto.check_fits``), on
the case that ran out of memory on an H100 (Llama 3.2 3B on Megatron, seq 4096: the step-2 OOM at mbs 2): inside the
memory model's error band of the usable memory a warning, past it a refusal unless ``train.allow_tight_fit``; each
names the estimate, the device's memory and the planner's pick as words that, typed, give a run that fits. With the
megatron engine's own planner profile (installed here)."""

from __future__ import annotations

import re

import pytest

from primus.core.contracts.errors import UserError
from primus.core.launch.rank import run_rank
from primus.core.launch.resolve import resolve, searched_micro_batches
from primus.core.planner import auto
from primus.core.planner.hardware import device

WORDS = ["backend.name=megatron", "train.seq_len=4096"]
H100 = device("H100")


def _check(*words: str):
    res = resolve("llama3.2-3b", [*WORDS, *words], world_size=1)
    return auto.check_fits(res.config, 1, H100, res.registry, searched_micro_batches(res))


def _words(said: str) -> list[str]:
    return re.search(r"; the planner's pick \([^)]*\): add (.*)$", said).group(1).split()  # last: copied as they are


def test_inside_the_band_warns_with_the_words_that_fit():
    said = _check("train.micro_batch_size=1")
    assert said.startswith("llama3.2-3b may not fit: an estimated 69.2 GiB per device (weights 6.0, ")
    assert "on H100 with 79.2 GiB (71.3 usable), within the memory model's ±10% of the usable memory" in said
    words = _words(said)
    assert "parallel.recompute=full" in words and "parallel.recompute_method=block" in words
    assert _check("train.micro_batch_size=1", *words) is None  # typed, it fits


def test_past_the_band_is_refused_unless_allowed():
    with pytest.raises(UserError) as refused:
        _check("train.micro_batch_size=2")
    said = str(refused.value)
    assert said.startswith("llama3.2-3b does not fit: an estimated 79.4 GiB per device")
    assert "past the memory model's ±10% (train.allow_tight_fit=true runs it anyway); the planner's pick (" in said
    words = _words(said)
    assert "parallel.recompute_layers=24" in words  # the planner's pick, as `primus plan` and auto have it
    assert _check("train.micro_batch_size=2", *words) is None
    allowed = _check("train.micro_batch_size=2", "train.allow_tight_fit=true")
    assert allowed.startswith("llama3.2-3b does not fit by the memory model: an estimated 79.4 GiB")
    assert "train.allow_tight_fit runs it" in allowed


def test_a_refused_run_writes_nothing(tmp_path, monkeypatch):
    import primus.core.kernels.selection

    out = tmp_path / "run"
    res = resolve("llama3.2-3b", [*WORDS, "train.micro_batch_size=2", f"logging.output_dir={out}"], world_size=1)
    monkeypatch.setattr(primus.core.kernels.selection, "detect_device", lambda: "cuda")
    monkeypatch.setattr(auto, "local_device", lambda: H100)
    with pytest.raises(UserError, match="does not fit"):
        run_rank(res)
    assert not out.exists()
