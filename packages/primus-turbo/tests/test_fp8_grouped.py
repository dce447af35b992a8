"""The FP8 grouped GEMM (primus.turbo.fp8.grouped) on CPU: the real fp8 GEMMs (``torch._scaled_mm`` per expert, which
torch 2.13 runs on CPU) against an independent per-expert emulation (operands rounded to e4m3 with the scales each GEMM
takes, fp32 products), against fp32, and the operands the grouped kernel (``torch._scaled_grouped_mm``, CUDA sm90 /
ROCm MI300+, not on CPU) would get, checked by torch's own meta function for it.

Bounds: emulation vs the fp8 GEMMs, the bf16 output's rounding (2⁻⁸ relative per element: < 0.5% in norm); vs fp32,
two e4m3 operands (~2.6% rms, the FP8 linear's bound of 5%).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from primus.core.kernels import reference
from primus.turbo.fp8 import grouped
from primus.turbo.fp8.grouped import ALIGN, fp8_grouped_gemm, grouped_gemm_for
from primus.turbo.fp8.recipe import Fp8Recipe

E4M3, ROUNDING = 0.05, 5e-3
# an expert with no token, one with fewer rows than ALIGN, rows past the last group (padding: undefined there)
OFFS = [10, 10, 40, 66]
T, K, N = 70, 32, 48


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fake_e4m3(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    """``t`` rounded to e4m3 with one scale per slice along ``dim`` (None: the whole tensor), back in fp32."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = 448.0 / amax.clamp(min=1e-12)
    return (t * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale


def emulated(x, w, dy, offs, rowwise: bool):
    """y, dx, dw per expert from e4m3-rounded operands: rowwise scales along each GEMM's reduction dim (the wgrad's
    over the expert's own tokens), tensorwise one per activation tensor and one per expert's matrix."""
    x, w, dy = x.float(), w.float(), dy.float()
    y, dx, dw = torch.zeros(T, N), torch.zeros(T, K), torch.zeros_like(w)
    xt, dyt = fake_e4m3(x, None), fake_e4m3(dy, None)
    start = 0
    for g, end in enumerate(offs):
        rows = slice(start, end)
        if rowwise:
            y[rows] = fake_e4m3(x[rows], -1) @ fake_e4m3(w[g], -1).T
            dx[rows] = fake_e4m3(dy[rows], -1) @ fake_e4m3(w[g], 0)
            if end > start:
                dw[g] = fake_e4m3(dy[rows], 0).T @ fake_e4m3(x[rows], 0)
        else:
            wg = fake_e4m3(w[g], None)
            y[rows], dx[rows], dw[g] = xt[rows] @ wg.T, dyt[rows] @ wg, dyt[rows].T @ xt[rows]
        start = end
    return y, dx, dw


def case(dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(len(OFFS), N, K, generator=gen) / K**0.5).requires_grad_()
    dy = torch.randn(T, N, generator=gen).to(dtype)
    return x, w, dy, torch.tensor(OFFS, dtype=torch.int32)


def run(x, w, dy, offs, recipe, impl="auto"):
    y = fp8_grouped_gemm(x, w, offs, recipe=recipe, impl=impl)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.fixture(params=["rowwise", "tensorwise"])
def mode(request):
    return request.param


# the quantizers: PyTorch ops, and the Triton kernels (primus.turbo.fp8.triton_grouped; Triton's interpreter on CPU)
@pytest.fixture(params=["torch", "triton"])
def impl(request):
    return request.param


def test_equals_the_per_expert_emulation_and_fp32(mode, impl):
    x, w, dy, offs = case()
    y, dx, dw = run(x, w, dy, offs, Fp8Recipe(mode=mode), impl)
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    ey, edx, edw = emulated(x.detach(), w.detach(), dy, OFFS, mode == "rowwise")
    live = slice(0, OFFS[-1])
    assert rel(y[live], ey[live]) < ROUNDING and rel(dx[live], edx[live]) < ROUNDING
    assert rel(dw, edw) < ROUNDING  # the kernel writes bf16 (cast to the weight's fp32 after)
    # the fp32 grouped GEMM and its gradients (core's reference loop)
    xr, wr = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    ry = reference.grouped_gemm(xr, wr, offs)
    ry[live].backward(dy[live].float())
    assert rel(y[live], ry[live]) < E4M3 and rel(dx[live], xr.grad[live]) < E4M3 and rel(dw, wr.grad) < E4M3
    assert dw[1].abs().max() == 0  # the expert without tokens: no gradient


def test_grouped_kernel_operands_pass_torchs_checks(monkeypatch, mode, impl):
    """With the grouped kernel chosen, every ``torch._scaled_grouped_mm`` call's operands go through torch's meta
    function for it (dtypes, row- / column-major layouts, 16-byte strides, scale shapes, int32 offsets), then through
    the per-expert path for numbers: the same results as the per-expert path chosen directly, and the weight
    gradient's groups start at multiples of 16."""
    calls, real = [], torch._scaled_grouped_mm

    def scaled_grouped_mm(a, b, scale_a, scale_b, *, offs, out_dtype, use_fast_accum):
        meta = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            for t in (a, b, scale_a, scale_b, offs)
        ]
        out = real(*meta[:4], offs=meta[4], out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        calls.append((a.dim(), b.dim(), offs.tolist(), tuple(out.shape)))
        return grouped.per_group_mm(a, b, scale_a, scale_b, offs, fast_accum=use_fast_accum)

    x, w, dy, offs = case()
    want = run(x, w, dy, offs, Fp8Recipe(mode=mode), impl)
    monkeypatch.setattr(grouped, "grouped_kernel_runs", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm)
    x, w, dy, offs = case()
    got = run(x, w, dy, offs, Fp8Recipe(mode=mode), impl)
    assert [c[:2] for c in calls] == [(2, 3), (2, 3), (2, 2)]  # forward, dgrad, wgrad
    assert calls[0][3] == (T, N) and calls[1][3] == (T, K) and calls[2][3] == (len(OFFS), N, K)
    padded = calls[2][2]
    assert padded == [16, 16, 48, 80] and all(end % ALIGN == 0 for end in padded)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_fp32_weights_under_bf16_autocast_and_bf16_weights():
    """TorchTitan's single-device runs: fp32 master weights, bf16 autocast (the GEMM in bf16, the weight's gradient
    fp32); megatron's: bf16 weights and activations."""
    x, w, dy, offs = case(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_grouped_gemm(x, w, offs, recipe=Fp8Recipe(mode="rowwise"))
    y.backward(dy.bfloat16())
    assert (y.dtype, x.grad.dtype, w.grad.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    x2, w2, dy2, _ = case()
    w2 = w2.detach().bfloat16().requires_grad_()
    y2 = fp8_grouped_gemm(x2, w2, offs, recipe=Fp8Recipe(mode="rowwise"))
    y2.backward(dy2)
    assert w2.grad.dtype == torch.bfloat16 and rel(w2.grad, w.grad) < E4M3


def test_output_gradient_is_e4m3_whatever_the_grad_dtype():
    """torch's grouped FP8 kernel multiplies e4m3 operands only: the experts' output gradient is e4m3 under either
    ``grad_dtype`` (the dense linears' keeps e5m2)."""
    results = []
    for grad_dtype in ("e4m3", "e5m2"):
        x, w, dy, offs = case()
        results.append(run(x, w, dy, offs, Fp8Recipe(mode="rowwise", grad_dtype=grad_dtype)))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_refusals_and_where_the_grouped_kernel_runs():
    x, w, _, offs = case()
    with pytest.raises(ValueError, match="current scaling only"):
        fp8_grouped_gemm(x, w, offs, recipe=Fp8Recipe(mode="tensorwise", scaling="delayed"))
    assert not grouped.grouped_kernel_runs(torch.device("cpu"))
    gemm = grouped_gemm_for(Fp8Recipe(mode="rowwise"))
    assert gemm.keywords["recipe"].fnuz is False  # this device's formats (not the MI300 series)
    assert torch.equal(gemm(x, w, offs), fp8_grouped_gemm(x, w, offs, recipe=Fp8Recipe(mode="rowwise")))


def test_triton_kernels_match_the_torch_quantizers_across_blocks():
    """The Triton kernels (interpreter on CPU) at shapes spanning several row and column blocks (a group longer than
    the jagged tile, weights with several tiles each way) against the PyTorch path's functions: scales exact, fp8
    bytes equal but where torch's ``fp8_max / amax`` (a reciprocal times fp8_max) puts a value on the other side of a
    rounding tie; the padded buffer, its zero rows and device-computed group ends as the torch path lays them out;
    a NaN only NaNs its own (expert, column) scale."""
    from primus.turbo.fp8 import triton_grouped as tg

    def same_bytes(a, b):
        return (a.view(torch.uint8) == b.view(torch.uint8)).float().mean().item()

    gen = torch.Generator().manual_seed(1)
    offs = torch.tensor([0, 200, 213, 290], dtype=torch.int32)  # empty, > JAG_ROWS, < ALIGN, rows 290.. outside
    t = (torch.randn(300, 70, generator=gen) * torch.logspace(-2, 1, 70)).bfloat16()
    t[250, 66] = float("nan")
    groups = len(offs)
    group, dest, padded_ends, length = grouped._padded_groups(offs, t.shape[0])
    for rowwise in (True, False):
        amax = None if rowwise else t.float().abs().nan_to_num(nan=float("inf")).amax()
        q, sinv, ends = tg.jagged_padded_t(t, offs, "e4m3", amax=amax, ends=True)
        ref, ref_sinv = grouped._jagged(t, group, groups, "e4m3", rowwise)
        ref_q = grouped._scatter_rows(ref, dest, group < groups, length).t()
        assert q.shape == ref_q.shape == (70, length) and torch.equal(ends, padded_ends)
        torch.testing.assert_close(sinv, ref_sinv.reshape(-1), rtol=0, atol=0, equal_nan=True)
        live = q[:, : int(padded_ends[-1])]  # past the last group: not written (no group reads it)
        assert same_bytes(live, ref_q[:, : int(padded_ends[-1])]) > 0.995
        assert padded_ends.tolist() == [0, 208, 224, 304]
        assert live[:, 221:224].float().abs().max() == 0 and live[:, 301:].float().abs().max() == 0  # the padding
    assert torch.isnan(sinv).all()  # tensorwise: the NaN's amax is everyone's
    nan_at = torch.isnan(tg.jagged_padded_t(t, offs, "e4m3")[1].view(groups, -1)).nonzero().tolist()
    assert nan_at == [[3, 66]]
    w = torch.randn(2, 70, 140, generator=gen) * torch.logspace(-2, 1, 140)
    for rowwise in (True, False):
        q, s, qt, st = tg.quantize_experts(w, "e4m3", rowwise)
        ref_q, ref_s = grouped._experts(w, "e4m3", rowwise, "torch")
        ref_qt, ref_st = grouped._experts(w.transpose(-2, -1).contiguous(), "e4m3", rowwise, "torch")
        torch.testing.assert_close((s, st), (ref_s, ref_st), rtol=0, atol=0)
        assert same_bytes(q, ref_q) > 0.995 and same_bytes(qt, ref_qt) > 0.995


def _compile_grouped_kernels() -> None:
    """The grouped quantization kernels compiled for sm_90 and gfx942 with a bf16 run's argument types (sizes
    multiples of 16, as the MoE shapes give): 16-byte loads and stores (the transposed ones too), no spills."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from primus.turbo.fp8 import triton_grouped as tg
    from primus.turbo.fp8.triton_quantize import fp8_grid

    bf16, f32, i32, f8 = "*bf16", "*fp32", "i32", "*fp8e4nv"
    common = {"FMAX": 448.0, "EPS": 1e-12, **fp8_grid("e4m3")}
    w_tile = {"ROWS": tg.W_ROWS, "COLS": tg.W_COLS}
    jag = {"ALIGN_ROWS": ALIGN, "BLOCK_G": 128, "ROWS": tg.JAG_ROWS, "COLS": tg.JAG_COLS, **common}
    kernels = [
        (tg._weight_amax_kernel, [bf16, f32, f32, i32, i32], {"K_PER": 512, "COLS_TOO": True, "SPLIT": True, **w_tile}, 4),
        (tg._weight_cast_kernel, [bf16, f8, f8] + [f32] * 4 + [i32] * 2, {"PER_MATRIX": False, "WRITE_Q": True, **common, **w_tile}, 8),
        (tg._jagged_kernel, [bf16, f8, f32, "*i32", "*i32", f32] + [i32] * 3, {"GIVEN_AMAX": False, "WRITE_ENDS": True, **jag}, 4),
    ]  # fmt: skip
    for fn, types, constexprs, warps in kernels:
        names = [n for n in fn.arg_names if n not in constexprs]
        signature = dict(zip(names, types, strict=True)) | dict.fromkeys(constexprs, "constexpr")
        divisible = [
            n for n, t in zip(names, types, strict=True) if t.startswith("*") or n in ("N", "K", "n_cols", "length")
        ]
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
        assert "ld.global.v4" in ptx, f"{fn.__name__}: no 16-byte loads"
        assert fn is tg._weight_amax_kernel or "st.global.v4" in ptx, f"{fn.__name__}: no 16-byte stores"
        assert "ld.local" not in ptx and "st.local" not in ptx, f"{fn.__name__}: spills to local memory"
        amdgcn = triton.compile(source, target=GPUTarget("hip", "gfx942", 64), options={"num_warps": warps}).asm[
            "amdgcn"
        ]
        assert re.search(r"private_segment_fixed_size: 0\b", amdgcn), f"{fn.__name__}: scratch"
        print(fn.__name__, "ok")


def test_triton_kernels_compile_for_sm90_and_gfx942(tmp_path):
    # a process of its own: the interpreter flag of this session replaces @triton.jit functions
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_fp8_grouped as t; t._compile_grouped_kernels()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count(" ok") == 3
