"""Core's loop stops early with a checkpoint (a stop signal, train.max_minutes), resumes with checkpoint.resume=auto,
and evaluates on held-out samples it never trains on; evaluation config and data are refused naming the key.

Core's stand-in engine (primus.core.run.testing) takes the real ones' place (tests/test_same_run.py and
tests/test_preemption.py run both engines): it records what the loop asks of it."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from primus.core.config.errors import ConfigError
from primus.core.launch.rank import run_rank
from primus.core.launch.resolve import resolve
from primus.core.run.testing import StandInEngine, registry

pytest.importorskip("torch")  # run_rank detects the device through torch


def _run(out: Path, *overrides: str) -> dict:
    StandInEngine.calls = []
    base = ["backend.name=stand-in", f"logging.output_dir={out}", "logging.tensorboard=false", "train.steps=8"]
    return run_rank(resolve("tiny-llama", [*base, *overrides], world_size=1, registry=registry()))


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_a_stop_signal_finishes_the_step_saves_and_resume_auto_continues(tmp_path):
    out = tmp_path / "run"
    previous = signal.getsignal(signal.SIGUSR1)
    summary = _run(out, "checkpoint.resume=auto", "backend.extra.signal_at=3", "logging.interval=5")
    assert summary["status"] == "preempted" and summary["stop_reason"] == "SIGUSR1"
    assert summary["final_step"] == 3 and summary["start_step"] == 0  # resume auto on an empty folder: fresh
    assert StandInEngine.calls == [("train", 1), ("train", 2), ("train", 3)]
    assert _checkpoints(out) == ["step_00000003"]  # one checkpoint, committed (interval 0: none before the end)
    assert [r["step"] for r in _rows(out)] == [3]  # the last step is logged even off the logging interval
    assert signal.getsignal(signal.SIGUSR1) == previous  # the loop's handlers are gone after the run

    summary = _run(out, "checkpoint.resume=auto", "logging.interval=5")  # the requeued job: same command
    assert summary["status"] == "ok" and summary["start_step"] == 3 and summary["final_step"] == 8
    assert StandInEngine.calls[0] == ("load", 3) and StandInEngine.calls[1] == ("train", 4)
    assert [r["step"] for r in _rows(out)] == [3, 5, 8]


def test_max_minutes_stops_like_a_signal(tmp_path):
    summary = _run(tmp_path / "run", "train.max_minutes=1e-9")
    assert summary["status"] == "preempted" and summary["stop_reason"] == "train.max_minutes"
    assert summary["final_step"] == 1 and _checkpoints(tmp_path / "run") == ["step_00000001"]


def test_evaluation_runs_on_its_steps_and_reaches_the_metrics(tmp_path):
    out = tmp_path / "run"
    summary = _run(out, "eval.holdout=0.1", "eval.interval=3", "eval.batches=2", "logging.interval=4")
    evals = [c for c in StandInEngine.calls if c[0] == "eval"]
    assert [c[1] for c in evals] == [3, 6, 8]  # every 3 steps and at the last
    assert all(c[3] == 2 for c in evals)
    rows = {r["step"]: r for r in _rows(out)}
    assert sorted(rows) == [3, 4, 6, 8]  # evaluation steps get a full metrics row
    assert rows[3]["eval_loss"] == 3.0 and rows[3]["eval_perplexity"] == pytest.approx(np.exp(3.0))
    assert "eval_loss" not in rows[4] and "grad_norm" in rows[3]
    assert summary["eval"]["step"] == 8 and summary["eval"]["eval_loss"] == 8.0


def test_held_out_samples_are_never_trained_on(tmp_path):
    from primus.core.data.splits import eval_samples, holdout_ids, training_samples

    cfg = resolve("tiny-llama", ["eval.holdout=0.1", "train.seq_len=64"], world_size=1, check_plugins=False).config
    train, held = training_samples(cfg), eval_samples(cfg)
    n = len(train) + len(held)
    assert len(held) == int(np.ceil(0.1 * n)) and len(train) > 0
    assert set(train.ids.tolist()).isdisjoint(held.ids.tolist())
    assert set(train.ids.tolist()) | set(held.ids.tolist()) == set(range(n))
    assert np.array_equal(holdout_ids(n, 0.1, cfg.train.seed), held.ids)  # drawn from the seed: reproducible
    assert not np.array_equal(holdout_ids(n, 0.1, cfg.train.seed + 1), held.ids)
    plain = resolve("tiny-llama", ["train.seq_len=64"], world_size=1, check_plugins=False).config
    assert len(training_samples(plain)) == n  # without a holdout every sample trains


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["eval.interval=5"], "eval.interval"),  # no evaluation data
        (["eval.holdout=0.1", "eval.source=x.jsonl"], "eval.holdout"),  # two sources
        (["eval.paths=[a.jsonl]"], "eval.paths"),
        (["eval.holdout=1.5"], "eval.holdout"),
        (["eval.holdout=0.1", "data.source=mock"], "eval.holdout"),
    ],
)
def test_bad_eval_configs_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as exc:
        resolve("tiny-llama", overrides, world_size=1, check_plugins=False)
    assert key in str(exc.value)


def test_eval_data_refused_before_the_run_folder_exists(tmp_path):
    from primus.core.data import DataError

    out = tmp_path / "run"
    with pytest.raises(DataError, match=r"eval\.source"):
        _run(out, f"eval.source={tmp_path / 'missing.jsonl'}", "eval.interval=2")
    with pytest.raises(DataError, match=r"eval\.batches 500 × train.global_batch_size 2 needs 1000 samples"):
        _run(out, "eval.holdout=0.01", "eval.interval=2", "eval.batches=500")
    assert not out.exists()


def _write_docs(path: Path, word: str, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"{word} " * 40 + f"{i}"}) + "\n" for i in range(n)))
    return path


def test_blend_draws_sources_by_weight_reproducibly(tmp_path):
    """Megatron's weight-path pairs: over 5,000 samples each source's share is within 2% of its weight; the draw
    is the seed's; the Megatron form and the structured form are the same blend."""
    from primus.core.data.splits import Blend, training_samples

    small = _write_docs(tmp_path / "small.jsonl", "alpha", 40)
    large = _write_docs(tmp_path / "large.jsonl", "omega", 400)
    over = ["train.seq_len=32", "model.vocab_size=2048"]
    cfg = resolve("tiny-llama", [f"data.blend=[0.2, {small}, 0.8, {large}]", *over], 1, check_plugins=False).config
    assert [(b.weight, b.path) for b in cfg.data.blend] == [(0.2, str(small)), (0.8, str(large))]
    blend = training_samples(cfg)
    assert isinstance(blend, Blend) and len(blend) == sum(len(d) for d in blend.datasets)
    draws = Blend(blend.datasets, [0.2, 0.8], cfg.train.seed)
    counts = np.bincount(np.concatenate([draws.source] * (5000 // len(draws) + 1))[:5000], minlength=2)
    assert abs(counts[0] / 5000 - 0.2) < 0.02 and abs(counts[1] / 5000 - 0.8) < 0.02
    again = training_samples(cfg)
    assert np.array_equal(again.source, blend.source) and np.array_equal(again.index, blend.index)
    other = Blend(blend.datasets, [0.2, 0.8], cfg.train.seed + 1)
    assert not np.array_equal(other.source, blend.source)
    # a small source cycles through all its samples before repeating one
    firsts = blend.index[blend.source == 0][: len(blend.datasets[0])]
    assert sorted(firsts.tolist()) == list(range(len(blend.datasets[0])))
    tokens = {int(t) for t in blend[int(np.flatnonzero(blend.source == 0)[0])][0]}
    structured = [f"data.blend=[{{weight: 0.2, path: {small}}}, {{weight: 0.8, path: {large}}}]", *over]
    same = training_samples(resolve("tiny-llama", structured, 1, check_plugins=False).config)
    assert np.array_equal(same.source, blend.source) and tokens


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["data.blend=[0.5, a.jsonl, 0.5]"], "data.blend"),  # odd number of items
        (["data.blend=[x, a.jsonl]"], "data.blend"),
        (["data.blend=[0.5, a.jsonl]", "data.paths=[b.jsonl]"], "data.paths"),
        (["data.blend=[-1, a.jsonl]"], "data.blend"),
    ],
)
def test_bad_blends_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as exc:
        resolve("tiny-llama", overrides, world_size=1, check_plugins=False)
    assert key in str(exc.value)


def test_a_missing_blend_source_is_refused_naming_its_entry(tmp_path):
    from primus.core.data import DataError
    from primus.core.data.checks import check_data

    good = _write_docs(tmp_path / "a.jsonl", "alpha", 5)
    cfg = resolve(
        "tiny-llama", [f"data.blend=[0.5, {good}, 0.5, {tmp_path / 'nope.jsonl'}]"], 1, check_plugins=False
    ).config
    with pytest.raises(DataError, match=r"data\.blend\[1\]\.path"):
        check_data(cfg)


def test_megatron_indexed_data_evaluates_as_auto_reads_it(tmp_path):
    """``data.format: megatron`` holds out (and reads ``eval.source``) the samples ``auto`` does of the same prefix: the
    same token stream, packed and split alike."""
    from primus.core.data.indexed import write_indexed
    from primus.core.data.splits import eval_samples, training_samples

    rng = np.random.default_rng(0)
    write_indexed(tmp_path / "ds", [rng.integers(1, 2000, size=int(n)) for n in rng.integers(20, 300, 60)])
    got = {}
    for fmt in ("auto", "megatron"):
        words = [f"data.source={tmp_path / 'ds'}", f"data.format={fmt}", "train.seq_len=64", "eval.holdout=0.1"]
        cfg = resolve("tiny-llama", words, world_size=1, check_plugins=False).config
        held, trained = eval_samples(cfg), training_samples(cfg)
        got[fmt] = ([held[i] for i in range(len(held))], len(trained))
        source = resolve(
            "tiny-llama", [*words[:3], f"eval.source={tmp_path / 'ds'}"], world_size=1, check_plugins=False
        )
        assert len(eval_samples(source.config)) > len(held)  # eval.source reads the whole prefix
    assert len(got["auto"][0]) > 0 and got["auto"][1] > 0
    assert all(np.array_equal(a, b) for a, b in zip(*(got[f][0] for f in got), strict=True))
    assert got["auto"][1] == got["megatron"][1]
