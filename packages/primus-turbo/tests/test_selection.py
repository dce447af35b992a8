"""primus-turbo's providers as core's selection sees them, through the installed entry point."""

from __future__ import annotations

import subprocess
import sys

import pytest

from primus.core.config.schema import KernelsConfig
from primus.core.kernels.selection import KernelUnavailable, select_kernels


def test_providers_are_registered_with_their_priorities(registry):
    by_name = {p.name: p for p in registry.providers("attention")}
    assert [p.name for p in registry.providers("attention")] == ["aiter", "cudnn", "flash", "flex", "ring", "sdpa"]
    want = {"aiter": 30, "cudnn": 20, "flash": 10, "flex": 8, "ring": 5, "sdpa": 0}
    assert {n: by_name[n].priority for n in by_name} == want
    assert {by_name[n].dist for n in ("aiter", "cudnn", "flash", "flex", "ring")} == {"primus-turbo"}
    assert by_name["sdpa"].dist == "primus-core"


def test_auto_on_cpu_picks_core_sdpa(registry):
    chosen = select_kernels(KernelsConfig(), registry, "cpu", dtype="bf16", head_dim=64)
    assert chosen["attention"].name == "sdpa"
    assert chosen["attention"].dist == "primus-core"


def test_cudnn_by_name_on_cpu_says_why(registry):
    with pytest.raises(KernelUnavailable, match="no CUDA device") as info:
        select_kernels(KernelsConfig(attention="cudnn"), registry, "cpu", dtype="bf16", head_dim=64)
    assert "primus-turbo" in str(info.value)


def test_auto_on_rocm_prefers_aiter_then_flash(registry, fake_aiter, rocm_torch, monkeypatch):
    chosen = select_kernels(KernelsConfig(), registry, "rocm", dtype="bf16", head_dim=128)
    assert chosen["attention"].name == "aiter"

    monkeypatch.setitem(sys.modules, "aiter", None)  # AITER not installed: flash is next
    chosen = select_kernels(KernelsConfig(), registry, "rocm", dtype="bf16", head_dim=128)
    assert chosen["attention"].name == "flash"

    chosen = select_kernels(KernelsConfig(), registry, "rocm", dtype="fp32", head_dim=128)
    assert chosen["attention"].name == "sdpa"  # no half-precision kernel takes fp32


def test_primus_plugins_lists_turbo():
    out = subprocess.run(
        [sys.executable, "-m", "primus.core.cli.app", "plugins"], capture_output=True, text=True, check=True
    ).stdout
    assert "primus-turbo" in out
    for name in ("attention:aiter", "attention:cudnn", "attention:flash", "attention:ring"):
        assert name in out
