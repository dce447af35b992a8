"""What both fp8 quantizers share (PyTorch in :mod:`.quantize`, Triton in :mod:`.triton_quantize`): the fp8
dtypes by format name, the amax floor, the amax → ``scale_inv`` rule and the :class:`Quantized` result.
See :mod:`.quantize` for the arithmetic and the handling of non-finite input."""

from __future__ import annotations

from typing import NamedTuple

import torch

from primus.turbo.fp8.recipe import FP8_MAX

AMAX_EPS = 1e-12
DTYPES = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz,  # AMD gfx942 (MI300 series)
    "e5m2fnuz": torch.float8_e5m2fnuz,
}


class Quantized(NamedTuple):
    data: torch.Tensor  # fp8, same shape as the input
    scale_inv: torch.Tensor  # fp32: () tensorwise, (rows, 1) rowwise
    amax: torch.Tensor  # fp32 amax of this input (() or (rows, 1)); for delayed scaling's history


def scale_from_amax(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """``fp8_max / amax`` (amax floored at :data:`AMAX_EPS`), 1 where amax is not finite (see :mod:`.quantize`)."""
    return torch.where(torch.isfinite(amax), FP8_MAX[fmt] / amax.clamp(min=AMAX_EPS), 1.0)


def scale_inv_from_amax(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """``amax / fp8_max`` in fp32, NaN where amax is not finite (see :mod:`.quantize`)."""
    amax = amax.float()
    return torch.where(torch.isfinite(amax), amax.clamp(min=AMAX_EPS) / FP8_MAX[fmt], torch.nan)
