"""Launch settings shared by the Triton kernels: warps per program, persistent grid size, row views.

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (numpy), which is how the tests check them on
a machine without a GPU; the settings below then only change how many Python-level programs run.
"""

from __future__ import annotations

import torch


def is_hip() -> bool:
    return getattr(torch.version, "hip", None) is not None


def num_warps(block: int) -> int:
    """Warps for a program that streams ``block`` elements: ~1 warp per 256 elements, 4 to 16 (a ROCm
    wavefront is 64 lanes, and 16 waves of 64 is the most a workgroup holds there)."""
    return max(4, min(16, block // 256))


def program_count(device: torch.device, per_sm: int = 2) -> int:
    """Programs for a persistent grid: a few per multiprocessor on a GPU, 4 on CPU (the interpreter)."""
    if device.type == "cuda":
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous ``[rows, last_dim]`` view (a copy only when it is not contiguous already)."""
    return x.contiguous().view(-1, x.shape[-1])
