"""The ``turbo`` entry point: the kernel providers primus-turbo registers.

Priorities order ``auto`` selection (highest available wins): AITER (ROCm) 30, cuDNN (CUDA) 20,
flash 10, core's plain SDPA 0.
"""

from __future__ import annotations

from primus.core import hookimpl
from primus.core.protocols import KernelProvider

_CHECK = "primus.turbo.availability"


@hookimpl
def primus_kernels() -> list[KernelProvider]:
    return [
        KernelProvider(
            op="attention",
            name="aiter",
            impl="primus.turbo.attention_aiter:attention",
            available=f"{_CHECK}:aiter",
            priority=30,
            description="AITER flash attention (ROCm, CK / asm v3 kernels)",
        ),
        KernelProvider(
            op="attention",
            name="cudnn",
            impl="primus.turbo.attention_sdpa:cudnn_attention",
            available=f"{_CHECK}:cudnn",
            priority=20,
            description="torch SDPA forced to the cuDNN backend (CUDA)",
        ),
        KernelProvider(
            op="attention",
            name="flash",
            impl="primus.turbo.attention_sdpa:flash_attention",
            available=f"{_CHECK}:flash",
            priority=10,
            description="torch SDPA forced to the flash backend (CUDA, ROCm)",
        ),
    ]
