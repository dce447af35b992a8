"""What an FP8 GEMM takes from the device and the autocast state: the MI300 series' fnuz formats, the ROCm GEMM
library, the dtype a plain GEMM would produce. Shared by the FP8 linear (:mod:`.linear`) and the FP8 grouped GEMM
(:mod:`.grouped`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from primus.turbo.availability import rocm_arch
from primus.turbo.fp8.recipe import Fp8Recipe


def rocm_fp8_formats_are_fnuz() -> bool:
    """Whether this process's GPU multiplies the fnuz FP8 formats: AMD's gfx94x (MI300 series). gfx950 (MI350
    series) and NVIDIA take the OCP ones."""
    if not getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return False
    return rocm_arch().startswith("gfx94")


def for_device(recipe: Fp8Recipe) -> Fp8Recipe:
    """``recipe`` with this device's FP8 formats (``fnuz`` on the MI300 series) and its ROCm GEMM library
    where there is one (``rocm_gemm`` means nothing elsewhere)."""
    rocm = bool(getattr(torch.version, "hip", None))
    return replace(recipe, fnuz=rocm_fp8_formats_are_fnuz(), rocm_gemm=recipe.rocm_gemm if rocm else "hipblaslt")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an ``nn.Linear`` would produce here: autocast's when it is on, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype
