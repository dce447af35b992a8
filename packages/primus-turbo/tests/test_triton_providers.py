"""The Triton providers as core's selection sees them, and every kernel compiled for an NVIDIA Hopper and
an AMD MI300 target (Triton compiles ahead of time without a GPU: this catches what the interpreter,
which runs the kernels as numpy, does not -- types, layouts, register allocation)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from primus.core.config.schema import KernelsConfig
from primus.core.kernels.selection import KernelUnavailable, select_kernels
from primus.turbo import availability

TRITON_OPS = ("rms_norm", "swiglu", "rope", "cross_entropy")


def test_triton_providers_are_registered(registry):
    for op in TRITON_OPS:
        by_name = {p.name: p for p in registry.providers(op)}
        assert by_name["triton"].priority == 20 and by_name["triton"].dist == "primus-turbo"
        assert by_name["triton"].priority > by_name["torch"].priority


def test_no_triton_kernels_on_cpu(registry):
    assert availability.triton_kernels("cpu").reason == "Triton kernels need a CUDA or ROCm device"
    chosen = select_kernels(KernelsConfig(), registry, "cpu", dtype="bf16", head_dim=64)
    assert {chosen[op].name for op in TRITON_OPS} == {"torch"}
    with pytest.raises(KernelUnavailable, match="Triton kernels need a CUDA or ROCm device"):
        select_kernels(KernelsConfig(rms_norm="triton"), registry, "cpu")


def test_triton_wins_auto_on_a_gpu_when_installed(registry, monkeypatch):
    pytest.importorskip("triton")
    for device in ("cuda", "rocm"):
        chosen = select_kernels(KernelsConfig(attention="sdpa"), registry, device, dtype="fp32", head_dim=64)
        assert {chosen[op].name for op in TRITON_OPS} == {"triton"}
    monkeypatch.setitem(sys.modules, "triton", None)  # not installed
    assert availability.triton_kernels("cuda").reason.startswith("triton is not installed")
    chosen = select_kernels(KernelsConfig(attention="sdpa"), registry, "cuda", dtype="bf16", head_dim=64)
    assert {chosen[op].name for op in TRITON_OPS} == {"torch"}


def test_providers_load_core_contract_callables():
    pytest.importorskip("triton")
    from primus.turbo.plugin import primus_kernels

    for provider in primus_kernels():
        if provider.name == "triton":
            assert callable(provider.load())


# Each kernel with the argument types of a bf16 run; constexprs as the Python wrappers pick them at
# Llama-3.2-1B shapes (d 2048, head_dim 64, vocab 128256).
_NOT_MULTIPLE_OF_16 = ("n_rows", "n_programs", "seq_len", "n_heads", "ignore_index")


def _compile_all() -> None:
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from primus.turbo.triton import cross_entropy, rms_norm, rope, swiglu
    from primus.turbo.triton.launch import num_warps

    bf16, f32, i32 = "*bf16", "*fp32", "i32"
    kernels = [
        (rms_norm._rms_norm_fwd, [bf16] * 5 + [f32, i32, "fp32"], {"BLOCK": 2048, "ADD": True}, num_warps(2048)),
        (rms_norm._rms_norm_bwd, [bf16] * 3 + [f32, bf16, bf16, f32, i32, i32, i32], {"BLOCK": 2048, "ADD_GRAD": True}, num_warps(2048)),
        (swiglu._swiglu_fwd, [bf16] * 3 + [i32] * 3, {"BLOCK": swiglu.BLOCK}, swiglu.NUM_WARPS),
        (swiglu._swiglu_bwd, [bf16] * 5 + [i32] * 4, {"BLOCK": swiglu.BLOCK}, swiglu.NUM_WARPS),
        (rope._rope_kernel, [bf16, f32, f32, bf16] + [i32] * 7, {"BLOCK_H": 32, "BLOCK_D": 32, "BACKWARD": True}, rope.NUM_WARPS),
        (cross_entropy._ce_fwd, [bf16, i32, "*i64", f32, f32, f32, bf16, i32, i32, i32], {"BLOCK_V": 8192, "WRITE_GRAD": True}, num_warps(8192)),
        (cross_entropy._ce_bwd, [bf16, i32, "*i64", f32, f32, bf16, i32, i32, i32], {"BLOCK_V": 8192}, num_warps(8192)),
    ]  # fmt: skip
    for fn, types, constexprs, warps in kernels:
        names = [n for n in fn.arg_names if n not in constexprs]
        signature = dict(zip(names, types, strict=True)) | dict.fromkeys(constexprs, "constexpr")
        # What the runtime JIT specialises on at these shapes: 16-byte aligned pointers, sizes and strides
        # that are multiples of 16.
        attrs = {
            (fn.arg_names.index(n),): [["tt.divisibility", 16]]
            for n, t in zip(names, types, strict=True)
            if t.startswith("*") or (t == i32 and n not in _NOT_MULTIPLE_OF_16)
        }
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        cuda = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert cuda.asm["cubin"]
        ptx = cuda.asm["ptx"]
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx, f"{fn.__name__}: no 16-byte accesses"
        assert "ld.local" not in ptx and "st.local" not in ptx, f"{fn.__name__}: spills to local memory"
        rocm = triton.compile(source, target=GPUTarget("hip", "gfx942", 64), options={"num_warps": warps})
        assert rocm.asm["hsaco"]
        assert re.search(r"private_segment_fixed_size: 0\b", rocm.asm["amdgcn"]), f"{fn.__name__}: scratch"
        print(fn.__name__, "ok")


def test_every_kernel_compiles_for_cuda_sm90_and_rocm_gfx942(tmp_path):
    """sm_90: 16-byte vector loads and stores, nothing spilled; gfx942: nothing spilled to scratch."""
    pytest.importorskip("triton")
    # A process of its own: the interpreter flag this test session sets replaces @triton.jit functions.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_triton_providers as t; t._compile_all()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count(" ok") == 7
