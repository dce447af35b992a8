"""FP8 training linears: e4m3 activations and weights, e5m2 (or e4m3) output gradients, GEMMs on
``torch._scaled_mm``; master weights, gradients and optimizer state stay in their own dtype (only the
GEMM operands are cast).

- :mod:`.recipe`: :class:`Fp8Recipe` (mode, grad dtype, current/delayed scaling) from ``kernels.fp8*``.
- :mod:`.quantize`: amax → scale → cast, PyTorch everywhere, fused Triton on a GPU.
- :mod:`.linear`: the autograd function, :class:`Float8Linear` and :func:`convert_to_fp8`.
- :mod:`.grouped`: the FP8 grouped GEMM for mixture-of-experts experts (``convert_to_fp8.grouped_gemm_for``).
- :mod:`.device`: the device's FP8 formats (fnuz on the MI300 series) and the compute dtype, for both.
- :mod:`.torchao_backend`: the same swap through ``torchao.float8`` where torchao is installed.

Where what runs: ``torch._scaled_mm`` runs on CUDA (compute capability 8.9+, FP8 tensor cores) and, in
torch 2.13, on CPU too (tensorwise and rowwise scales); the Triton quantizer runs on CUDA (on CPU the
PyTorch quantizer is used: Triton's interpreter mis-rounds fp8 casts that carry into the next binade).
"""

from __future__ import annotations

from typing import Any

from primus.turbo.fp8.recipe import Fp8Recipe

__all__ = ["Float8Linear", "Fp8Recipe", "Fp8State", "convert_to_fp8", "fp8_linear"]


def __getattr__(name: str) -> Any:
    # torch is imported on first use of the linear, so recipe.py's config checks stay torch-free
    if name in ("Float8Linear", "Fp8State", "convert_to_fp8", "fp8_linear"):
        from primus.turbo.fp8 import linear

        return getattr(linear, name)
    raise AttributeError(name)
