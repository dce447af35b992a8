"""primus-turbo's grouped GEMM (torch's grouped_mm) against core's per-expert loop: outputs and gradients, fp32 on
CPU (torch's CPU grouped_mm), bf16 on a GPU; its selection and its refusal of unaligned rows."""

from __future__ import annotations

import pytest
import torch

from primus.core.config.schema import KernelsConfig
from primus.core.kernels import reference as ref
from primus.core.kernels.selection import select_kernels
from primus.turbo import availability
from primus.turbo.grouped_gemm import grouped_gemm

# groups of 5, 0 (an expert no token chose), 11 and 16 rows; 4 padding rows past offs[-1] (EP's padded layout)
COUNTS = [5, 0, 11, 16]
PADDING = 4


def _inputs(device, dtype, k=64, n=96):
    g = torch.Generator().manual_seed(0)
    t = sum(COUNTS) + PADDING
    x = torch.randn(t, k, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(len(COUNTS), n, k, generator=g) / k**0.5).to(device, dtype).requires_grad_()
    offs = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0).to(device=device, dtype=torch.int32)
    dy = torch.randn(t, n, generator=g).to(device, dtype)
    dy[sum(COUNTS) :] = 0  # padding rows carry no gradient (the engines drop them)
    return x, w, offs, dy


def _run(fn, x, w, offs, dy):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w, offs)
    y.backward(dy)
    return y[: int(offs[-1])], x.grad[: int(offs[-1])], w.grad


def test_grouped_mm_equals_the_per_expert_loop_fp32_cpu():
    x, w, offs, dy = _inputs("cpu", torch.float32)
    got, want = _run(grouped_gemm, x, w, offs, dy), _run(ref.grouped_gemm, x, w, offs, dy)
    for name, a, b in zip(("output", "x grad", "w grad"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    assert want[2][1].abs().max() == 0 and got[2][1].abs().max() == 0  # the empty group


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 grouped_mm kernels: a CUDA GPU")
def test_grouped_mm_equals_the_per_expert_loop_bf16_gpu():
    x, w, offs, dy = _inputs("cuda", torch.bfloat16, k=2048, n=768)
    got = _run(grouped_gemm, x, w, offs, dy)
    want = _run(ref.grouped_gemm, x.float(), w.float(), offs, dy.float())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2)


def test_autocast_runs_the_grouped_gemms_in_its_dtype():
    """Autocast does not cover grouped_mm; the provider casts as autocast casts a matmul (fp32 weights under bf16
    autocast: torchtitan on one GPU)."""
    x, w, offs, _ = _inputs("cpu", torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_gemm(x, w, offs)
        want = ref.grouped_gemm(x, w, offs)  # matmuls: autocast's bf16
    assert y.dtype == torch.bfloat16 == want.dtype
    n = int(offs[-1])
    torch.testing.assert_close(y[:n].float(), want[:n].float(), rtol=2e-2, atol=2e-2)


def test_unaligned_rows_are_refused_naming_the_size():
    x, w, offs, _ = _inputs("cpu", torch.bfloat16, k=12)
    with pytest.raises(ValueError, match=r"K \(x's last dim\) = 12 is not a multiple of 16 bytes"):
        grouped_gemm(x, w, offs)


def test_selection_takes_grouped_mm_over_the_loop(registry):
    assert [p.name for p in registry.providers("grouped_gemm")] == ["grouped_mm", "torch"]
    assert select_kernels(KernelsConfig(), registry, "cpu")["grouped_gemm"].name == "grouped_mm"
    chosen = select_kernels(KernelsConfig(grouped_gemm="torch"), registry, "cpu")
    assert chosen["grouped_gemm"].load() is ref.grouped_gemm
    assert availability.grouped_mm("cpu", dtype="fp32")
    # the GPU kernels are bf16 only: an fp32 run on a GPU keeps the loop, saying why
    why = availability.grouped_mm("rocm", dtype="fp32")
    assert not why and "takes bf16 (got fp32)" in why.reason
