"""FP8 provider selection (kernels.fp8 / fp8_recipe.implementation) and the Triton quantizer (interpreter)."""

from __future__ import annotations

import pytest
import torch

from primus.core.config.schema import KernelsConfig
from primus.core.kernels.selection import KernelUnavailable, select_fp8, select_kernels
from primus.turbo import availability
from primus.turbo.fp8.quantize import quantize_torch
from primus.turbo.fp8.recipe import Fp8Recipe
from primus.turbo.fp8.torchao_backend import unsupported


def test_off_selects_nothing(registry):
    assert "fp8" not in select_kernels(KernelsConfig(), registry, "cpu")


def test_cpu_selects_primus_fp8(registry):
    assert select_fp8(KernelsConfig(fp8="rowwise"), registry, "cpu").name == "fp8"


def test_auto_prefers_primus_fp8_where_both_run(registry, monkeypatch):
    """Both FP8 linears available (as on a CUDA GPU with torchao installed): ``auto`` takes primus-turbo's, the
    faster of the two on the H200 in 4 of 5 compiled runs; torchao's is there when asked for."""
    ok = availability.Availability(True, "")
    monkeypatch.setattr(availability, "fp8", lambda device, **_: ok)
    monkeypatch.setattr(availability, "torchao_fp8", lambda device, **_: ok)
    assert select_fp8(KernelsConfig(fp8="tensorwise"), registry, "cuda").name == "fp8"
    asked = KernelsConfig(fp8="tensorwise", fp8_recipe={"implementation": "torchao"})
    assert select_fp8(asked, registry, "cuda").name == "torchao"


def test_a_mixture_of_experts_model_takes_a_provider_with_an_fp8_grouped_gemm(registry, monkeypatch):
    """Only primus-turbo's FP8 provider offers the experts' FP8 grouped GEMM (its fp8_grouped_gemm feature): chosen
    for an MoE model; torchao's, even where it runs, is passed over with the reason."""
    ok = availability.Availability(True, "")
    monkeypatch.setattr(availability, "fp8", lambda device, **_: ok)
    monkeypatch.setattr(availability, "torchao_fp8", lambda device, **_: ok)
    fp8 = select_fp8(KernelsConfig(fp8="rowwise"), registry, "cuda", moe=True)
    assert fp8.name == "fp8" and hasattr(fp8.load(), "grouped_gemm_for")
    asked = KernelsConfig(fp8="tensorwise", fp8_recipe={"implementation": "torchao"})
    assert select_fp8(asked, registry, "cuda").name == "torchao"  # a dense model
    with pytest.raises(KernelUnavailable, match="torchao: has no FP8 grouped GEMM for a mixture-of-experts"):
        select_fp8(asked, registry, "cuda", moe=True)


def test_experts_stay_bf16_unless_measured_faster(registry, monkeypatch, caplog):
    """core's rule over the provider's measurement: ``auto`` takes the FP8 grouped GEMM only where it was measured
    faster than bf16 on this device (a measured 0.15x keeps bf16, a device not measured too); ``fp8`` forces it with a
    warning naming the ratio; ``bf16`` keeps bf16 whatever was measured."""
    from primus.core.kernels.selection import fp8_experts
    from primus.turbo.fp8 import grouped

    fp8 = select_fp8(KernelsConfig(fp8="rowwise"), registry, "cpu", moe=True)
    auto, forced = KernelsConfig(fp8="rowwise"), KernelsConfig(fp8="rowwise", fp8_recipe={"experts": "fp8"})
    assert grouped.grouped_gemm_speedup() is None  # no GPU: not measured here
    use, why = fp8_experts(auto, fp8)
    assert not use and "not measured on this device, not faster than bf16" in why
    monkeypatch.setattr(grouped, "grouped_gemm_speedup", lambda: 0.15)
    monkeypatch.setattr(fp8.load(), "grouped_gemm_speedup", lambda: 0.15)
    assert fp8_experts(auto, fp8) == (
        False,
        "routed experts bf16: fp8's FP8 grouped GEMM is measured 0.15x bf16's, fwd + bwd, not faster than bf16 "
        "(kernels.fp8_recipe.experts: fp8 forces it)",
    )
    with caplog.at_level("WARNING", logger="primus.kernels"):
        use, why = fp8_experts(forced, fp8)
    assert use and why.endswith("forced (measured 0.15x bf16's, fwd + bwd)")
    assert "forces FP8 grouped GEMMs for the experts (measured 0.15x" in caplog.text
    monkeypatch.setattr(fp8.load(), "grouped_gemm_speedup", lambda: 1.3)
    assert fp8_experts(auto, fp8)[0]
    assert not fp8_experts(KernelsConfig(fp8="rowwise", fp8_recipe={"experts": "bf16"}), fp8)[0]


def test_torchao_asked_for_on_cpu_names_why(registry):
    cfg = KernelsConfig(fp8="tensorwise", fp8_recipe={"implementation": "torchao"})
    with pytest.raises(KernelUnavailable, match=r"kernels.fp8=tensorwise: cannot run on cpu \(torchao: .*CUDA"):
        select_fp8(cfg, registry, "cpu")


def test_delayed_rowwise_refused_with_reason(registry):
    cfg = KernelsConfig(fp8="rowwise", fp8_recipe={"scaling": "delayed", "implementation": "primus"})
    with pytest.raises(KernelUnavailable, match="amax history per tensor"):
        select_fp8(cfg, registry, "cpu")


def test_availability_reasons():
    assert availability.fp8("cpu")  # torch 2.13 runs _scaled_mm on CPU
    assert "rowwise recipe casts gradients to e4m3" in unsupported(Fp8Recipe(mode="rowwise"))
    assert "dynamic" in unsupported(Fp8Recipe(scaling="delayed"))
    assert unsupported(Fp8Recipe()) == ""


@pytest.mark.parametrize("rowwise,delayed", [(False, False), (True, False), (False, True)])  # delayed: tensorwise
def test_triton_quantizer_matches_torch(rowwise, delayed):
    """Scales exact; fp8 bytes: Triton's *interpreter* mis-rounds values that carry into the next binade
    (e.g. 126 → 64 instead of 128), so on CPU only ≥ 90% of the bytes are checked equal. The GPU benchmark
    (benchmarks/fp8_training.py) checks the compiled kernel byte for byte."""
    from primus.turbo.fp8 import triton_quantize

    x = (torch.randn(24, 300) * 3).to(torch.bfloat16)
    x[2, 7] = 0.0
    amax = torch.tensor(20.0) if delayed else None
    got = triton_quantize.quantize(x, "e4m3", rowwise=rowwise, amax=amax)
    ref = quantize_torch(x, "e4m3", rowwise=rowwise, amax=amax)
    torch.testing.assert_close(got.scale_inv, ref.scale_inv, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.amax, ref.amax)
    assert (got.data.view(torch.uint8) == ref.data.view(torch.uint8)).float().mean() > 0.9


def test_triton_quantizer_nan_makes_nan_scale():
    from primus.turbo.fp8 import triton_quantize

    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    assert torch.isnan(triton_quantize.quantize(x, "e4m3", rowwise=False).scale_inv)
    row = triton_quantize.quantize(x, "e4m3", rowwise=True).scale_inv
    assert torch.isnan(row[1]).all() and torch.isfinite(row[[0, 2, 3]]).all()
