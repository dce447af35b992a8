"""Each provider's availability rules, with the reason a user sees when it cannot run."""

from __future__ import annotations

import sys

import pytest
import torch

from primus.turbo import availability


@pytest.mark.parametrize(
    ("check", "reason"),
    [
        (availability.cudnn, "no CUDA device"),
        (availability.flash, "no CUDA or ROCm device"),
        (availability.aiter, "no ROCm device"),
    ],
)
def test_nothing_runs_on_cpu(check, reason):
    result = check("cpu", dtype="bf16", head_dim=64)
    assert not result
    assert result.reason == reason


def test_cudnn_on_rocm_says_why():
    assert availability.cudnn("rocm").reason == "no CUDA device (ROCm has no cuDNN)"


@pytest.mark.parametrize(
    ("dtype", "head_dim", "reason"),
    [
        ("bf16", 64, ""),
        ("fp16", 256, ""),
        (torch.bfloat16, 128, ""),
        (None, None, ""),
        ("fp32", 64, "dtype must be fp16 or bf16 (got fp32)"),
        (torch.float32, 64, "dtype must be fp16 or bf16 (got fp32)"),
        ("bf16", 36, "head_dim must be a multiple of 8 and <= 256 (got 36)"),
        ("bf16", 264, "head_dim must be a multiple of 8 and <= 256 (got 264)"),
    ],
)
def test_shape_rules(dtype, head_dim, reason):
    assert availability.shape_reason(dtype, head_dim) == reason


def test_aiter_needs_rocm_torch_and_the_library(fake_aiter, rocm_torch, monkeypatch):
    assert availability.aiter("rocm", dtype="bf16", head_dim=128)
    assert availability.aiter("rocm", dtype="fp32", head_dim=128).reason == "dtype must be fp16 or bf16 (got fp32)"
    assert availability.aiter("cuda").reason == "no ROCm device"

    monkeypatch.setitem(sys.modules, "aiter", None)  # an import of aiter now raises ImportError
    assert availability.aiter("rocm").reason.startswith("aiter is not installed")

    monkeypatch.setattr(torch.version, "hip", None)
    assert availability.aiter("rocm").reason == "torch is not a ROCm build"


def test_flash_on_rocm_checks_only_shapes():
    assert availability.flash("rocm", dtype="bf16", head_dim=128)
    assert availability.flash("rocm", dtype="fp32").reason == "dtype must be fp16 or bf16 (got fp32)"
