"""The results file: round trip, winner rule, and the device/version check on load."""

from __future__ import annotations

import json
import logging

import pytest

from primus.tune.results import (
    Environment,
    GemmResults,
    GemmTuningMismatch,
    TuningEntry,
    current_environment,
    load_results,
    pick_winner,
    read_results,
)
from primus.tune.shapes import linear_gemms

H200 = Environment("NVIDIA H200", "cuda", "12.8", "cublasLt 120804", "2.11.0")


def _results() -> GemmResults:
    fwd, dgrad, wgrad = linear_gemms(8192, 2048, 8192)
    res = GemmResults(H200, searcher="cublaslt")
    sol = {"algorithm": "AAEC", "algorithm_id": 66, "heuristic_index": 3, "candidates": 8}
    res.add(TuningEntry(fwd, 690.0, 716.0, sol, pick_winner(690.0, 716.0, 0.01), "cublaslt"))
    res.add(TuningEntry(dgrad, 719.0, 623.0, sol, pick_winner(719.0, 623.0, 0.01), "cublaslt"))
    res.add(TuningEntry(wgrad, 700.0, 703.0, sol, pick_winner(700.0, 703.0, 0.01), "cublaslt"))
    return res


def test_round_trip_keeps_every_field(tmp_path):
    res = _results()
    path = res.save(tmp_path / "gemm" / "r.json")
    back = read_results(path)
    assert back.to_dict() == res.to_dict()
    assert back.environment == H200
    fwd, dgrad, wgrad = (back.entries[g.key] for g in linear_gemms(8192, 2048, 8192))
    assert (fwd.winner, dgrad.winner, wgrad.winner) == ("tuned", "default", "default")  # -13% and +0.4% lose
    assert set(back.tuned()) == {fwd.shape.key}
    assert fwd.gain == pytest.approx(716 / 690 - 1)
    assert json.loads(path.read_text())["format"] == "primus-gemm-results/1"


def test_winner_keeps_the_default_on_ties_and_losses():
    assert pick_winner(700.0, 706.0, 0.01) == "default"  # +0.9% is within the margin
    assert pick_winner(700.0, 710.0, 0.01) == "tuned"
    assert pick_winner(700.0, 600.0) == "default"
    assert pick_winner(700.0, None) == "default"


def test_same_environment_loads_silently(tmp_path, caplog):
    path = _results().save(tmp_path / "r.json")
    with caplog.at_level(logging.WARNING, logger="primus.tune"):
        res = load_results(path, H200, "refuse")
    assert len(res.entries) == 3 and not caplog.records


def test_other_device_or_version_warns_or_refuses(tmp_path, caplog):
    path = _results().save(tmp_path / "r.json")
    mi300 = Environment("AMD Instinct MI300X", "rocm", "6.4", "hipblaslt 0.14", "2.11.0")
    with pytest.raises(GemmTuningMismatch, match="device: file 'NVIDIA H200', here 'AMD Instinct MI300X'"):
        load_results(path, mi300, "refuse")
    newer_torch = Environment("NVIDIA H200", "cuda", "12.8", "cublasLt 120804", "2.13.0")
    with caplog.at_level(logging.WARNING, logger="primus.tune"):
        res = load_results(path, newer_torch, "warn")
    assert len(res.entries) == 3
    assert "torch: file '2.11.0', here '2.13.0'" in caplog.text
    with pytest.raises(ValueError, match="on_mismatch"):
        load_results(path, H200, "ignore")


def test_missing_and_foreign_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="primus tune gemm run"):
        load_results(tmp_path / "none.json", H200)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="not a GEMM results file"):
        read_results(bad)


def test_current_environment_on_cpu():
    env = current_environment()
    assert env.platform == "cpu" and env.device == "cpu" and env.torch
