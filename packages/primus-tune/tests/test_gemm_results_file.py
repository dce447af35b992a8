"""primus_configure: offline / online GEMM tuning without a results file gets the per-model default file."""

from __future__ import annotations

from pathlib import Path

from primus.tune import plugin
from primus.tune.gemm import default_results_file


def test_offline_without_file_gets_the_default(cache_home):
    cfg = {"model": {"name": "llama3.1-8b"}, "train": {"precision": "bf16"}, "kernels": {"gemm_tuning": "offline"}}
    assert plugin.primus_configure(config=cfg) == {
        "kernels.gemm_tuning_file": str(cache_home / "primus" / "gemm" / "llama3.1-8b-bf16.json")
    }


def test_online_writes_to_the_default_file_too(cache_home):
    cfg = {"model": {"name": "llama3.2-1b"}, "kernels": {"gemm_tuning": "online"}}
    assert plugin.primus_configure(config=cfg) == {
        "kernels.gemm_tuning_file": str(cache_home / "primus" / "gemm" / "llama3.2-1b-bf16.json")
    }


def test_other_modes_and_explicit_files_are_left_alone(cache_home):
    assert plugin.primus_configure(config={}) is None
    assert plugin.primus_configure(config={"kernels": {"gemm_tuning": "off"}}) is None
    explicit = {"kernels": {"gemm_tuning": "offline", "gemm_tuning_file": "/data/gemm.csv"}}
    assert plugin.primus_configure(config=explicit) is None


def test_schema_defaults_fill_missing_keys_and_names_are_safe(cache_home, monkeypatch):
    assert default_results_file({}).name == "tiny-llama-bf16.json"
    assert default_results_file({"model": {"name": "org/my model"}}).name == "org_my_model-bf16.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_results_file({}).parent == Path.home() / ".cache" / "primus" / "gemm"
