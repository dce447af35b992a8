"""Grouped GEMM for mixture-of-experts: every expert's GEMM in one launch, through torch's ``grouped_mm``.

``torch.nn.functional.grouped_mm`` (torch 2.13; ``torch._grouped_mm`` before) runs CUTLASS grouped kernels on
CUDA (sm80+, bf16), CK on ROCm (gfx942 / gfx950, torch 2.10+; written against that API, not run here: no AMD GPU)
and a loop of matmuls on CPU; its autograd computes dgrad as another grouped GEMM and wgrad as the 2-D × 2-D
grouped form (both operands split by ``offs``). A loop of per-expert matmuls (core's reference, megatron's
SequentialMLP) launches 3 × experts small GEMMs per layer forward; at 128 experts that loop, not the math, set
the step time (``benchmarks/moe_h200.py``).

Contract (:mod:`primus.core.kernels.selection`): x ``[T, K]`` sorted by expert, w ``[G, N, K]``, offs ``[G]`` int32
cumulative group ends; y ``[T, N]``; rows past ``offs[-1]`` undefined.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The grouped kernels read rows with 16-byte aligned strides (TMA on Hopper): K and N a multiple of 16 bytes.
ALIGN_BYTES = 16


def _grouped_mm():
    return getattr(F, "grouped_mm", None) or torch._grouped_mm


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # Autocast does not cover grouped_mm: under it (torchtitan on one GPU: fp32 weights, bf16 autocast) the operands
    # are cast as autocast casts a matmul's, else the GPU runs fp32 grouped GEMMs (measured: half the step rate).
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    for name, size in (("K (x's last dim)", x.shape[-1]), ("N (w's rows per expert)", w.shape[1])):
        if size * x.element_size() % ALIGN_BYTES:
            raise ValueError(
                f"grouped_gemm: {name} = {size} is not a multiple of {ALIGN_BYTES} bytes in {x.dtype} "
                "(torch's grouped kernels need 16-byte aligned rows); use kernels.grouped_gemm: torch"
            )
    if offs.dtype != torch.int32:
        offs = offs.to(torch.int32)
    # w [G, N, K] -> [G, K, N] as a view: the column-major right operand the kernels take
    return _grouped_mm()(x, w.transpose(-2, -1), offs=offs)
