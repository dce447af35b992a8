"""The FP8 linear's ROCm paths, on CPU: the fnuz formats of the MI300 series, the choice of formats and GEMM
library from the device, and the AITER ``gemm_a8w8`` contract against a stand-in computing what AITER documents
(``Y = (XQ · WQᵀ) · x_scale · w_scale``; XQ [m, k], WQ [n, k], x_scale [m, 1], w_scale [1, n], fp32 scales).

Not run: AMD GPUs (none here). What runs is the arithmetic and the calls the real library would get.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from primus.turbo import availability
from primus.turbo.fp8.linear import for_device, fp8_linear
from primus.turbo.fp8.quantize import dequantize, quantize_torch
from primus.turbo.fp8.recipe import Fp8Recipe


def test_fnuz_e4m3_tops_out_at_240():
    x = torch.randn(64, 32) * 1000
    q = quantize_torch(x, "e4m3fnuz", rowwise=False)
    assert q.data.dtype == torch.float8_e4m3fnuz
    assert q.data.float().abs().max().item() == 240.0  # the amax lands on the format's largest value
    assert q.scale_inv.item() == pytest.approx(x.abs().max().item() / 240.0)
    assert ((dequantize(q) - x).norm() / x.norm()).item() < 0.05
    assert quantize_torch(x, "e5m2fnuz", rowwise=True).data.dtype == torch.float8_e5m2fnuz


@pytest.fixture
def gpu_arch(monkeypatch):
    """Make torch report one GPU of the given architecture (``gpu_arch("gfx942")``)."""

    def set_arch(arch: str) -> None:
        props = types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)

    return set_arch


def test_formats_and_gemm_library_follow_the_device(rocm_torch, gpu_arch):
    gpu_arch("gfx942")  # MI300X: fnuz
    r = for_device(Fp8Recipe(rocm_gemm="aiter"))
    assert r.fnuz and (r.forward_format, r.grad_format) == ("e4m3fnuz", "e5m2fnuz") and r.rocm_gemm == "aiter"
    gpu_arch("gfx950")  # MI355X: the OCP formats
    assert not for_device(Fp8Recipe()).fnuz


def test_off_rocm_the_recipe_keeps_ocp_formats_and_torch_scaled_mm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    r = for_device(Fp8Recipe(rocm_gemm="aiter"))
    assert not r.fnuz and r.rocm_gemm == "hipblaslt"


def test_availability_on_rocm_names_the_architecture_and_aiter(rocm_torch, gpu_arch, monkeypatch):
    gpu_arch("gfx942")
    assert availability.fp8("rocm")
    monkeypatch.setitem(sys.modules, "aiter", None)  # import aiter -> ImportError
    assert "aiter is not installed" in availability.fp8("rocm", rocm_gemm="aiter").reason
    gpu_arch("gfx90a")  # MI250X: no FP8 matrix cores
    assert availability.fp8("rocm").reason.startswith("gfx90a has no FP8 GEMMs")


@pytest.fixture
def aiter_gemm(monkeypatch):
    """A stand-in ``aiter`` with ``gemm_a8w8`` as AITER's gemm_op_a8w8.py defines it; records each call."""
    calls = []

    def gemm_a8w8(XQ, WQ, x_scale, w_scale, bias=None, dtype=torch.bfloat16, splitK=None):  # noqa: N803
        calls.append({"XQ": (XQ.shape, XQ.dtype), "WQ": (WQ.shape, WQ.dtype), "x": x_scale.shape, "w": w_scale.shape})
        assert x_scale.dtype == w_scale.dtype == torch.float32 and bias is None
        assert dtype in (torch.bfloat16, torch.float16)  # CK's outputs
        return ((XQ.float() @ WQ.float().t()) * x_scale * w_scale).to(dtype)

    module = types.ModuleType("aiter")
    module.gemm_a8w8 = gemm_a8w8
    monkeypatch.setitem(sys.modules, "aiter", module)
    return calls


@pytest.mark.skipif(bool(availability._cpu_scaled_mm_reason()), reason="torch._scaled_mm does not run on this CPU")
@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_aiter_gemms_match_scaled_mm(aiter_gemm, mode):
    torch.manual_seed(0)
    x, w = torch.randn(48, 64), torch.randn(32, 64)  # bf16 weights: every GEMM's output is bf16

    def run(recipe):
        xi, wi = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        y = fp8_linear(xi, wi, recipe=recipe)
        y.float().square().sum().backward()
        return y, xi.grad, wi.grad

    ref = run(Fp8Recipe(mode=mode))
    got = run(Fp8Recipe(mode=mode, rocm_gemm="aiter"))
    assert len(aiter_gemm) == 3  # forward, dgrad, wgrad
    fwd, dgrad, wgrad = aiter_gemm
    assert fwd["XQ"] == (torch.Size([48, 64]), torch.float8_e4m3fn) and fwd["WQ"][0] == torch.Size([32, 64])
    assert (fwd["x"], fwd["w"]) == (torch.Size([48, 1]), torch.Size([1, 32]))  # tensorwise scales broadcast
    assert dgrad["XQ"][1] == torch.float8_e5m2 and wgrad["x"] == torch.Size([32, 1])
    for a, b in zip(got, ref, strict=True):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


@pytest.mark.skipif(bool(availability._cpu_scaled_mm_reason()), reason="torch._scaled_mm does not run on this CPU")
def test_fp32_weight_gradients_stay_on_scaled_mm(aiter_gemm):
    x, w = torch.randn(48, 64, requires_grad=True), torch.randn(32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, w, recipe=Fp8Recipe(rocm_gemm="aiter"))
    y.float().sum().backward()
    assert len(aiter_gemm) == 2 and w.grad.dtype == torch.float32  # forward and dgrad; wgrad in fp32 elsewhere
