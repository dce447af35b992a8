"""The ``turbo`` entry point: the kernel providers primus-turbo registers.

Priorities order ``auto`` selection (highest available wins): AITER (ROCm) 30, cuDNN (CUDA) 20,
flash 10, flex 8, ring 5, core's plain SDPA 0. ``flex`` (FlexAttention, :mod:`primus.turbo.attention_flex`) alone of
them masks by document (the ``"documents"`` feature): with ``data.document_mask`` selection skips the others, so
``auto`` takes it on a GPU and core's SDPA on CPU. ``ring`` (context-parallel attention, :mod:`primus.turbo.context_parallel`)
declares the ``"context_parallel"`` feature and is available only under the constraint ``cp > 1``, which the other
attention providers refuse: with ``cp`` passed at selection, ``auto`` picks it exactly when the sequence is split. The Triton kernels (rms_norm, swiglu, rope, cross_entropy) are 20, above
core's plain-PyTorch ones (0), on any CUDA or ROCm device with ``triton`` installed.

FP8 linears are ``gemm`` providers, chosen by ``kernels.fp8`` / ``fp8_recipe.implementation`` (not by
``auto`` over the ops): primus-turbo's ``fp8`` (30) before ``torchao`` (20, where torchao is installed). On the
H200, compiled, primus-turbo's linear ran 1-3% faster than torchao's on Llama 3.2 3B and 1B with an accumulated
batch (slower on 1B with one micro-batch per step; ``benchmarks/README.md``, session 5), and it alone offers
delayed scaling, rowwise with e5m2 gradients and megatron's linears.
Their impl is the model swap ``convert_to_fp8(model, recipe, skip) -> names swapped``.
"""

from __future__ import annotations

from primus.core import hookimpl
from primus.core.protocols import DOCUMENTS, KernelProvider

_CHECK = "primus.turbo.availability"

# op -> (module:function under primus.turbo.triton, description)
TRITON_OPS = {
    "rms_norm": ("rms_norm:rms_norm", "Triton RMSNorm, one pass forward, persistent backward"),
    "swiglu": ("swiglu:swiglu", "Triton elementwise silu(gate) * up, fwd + bwd"),
    "rope": ("rope:rope", "Triton rotate-half RoPE, cos/sin row shared by the heads of a position"),
    "cross_entropy": ("cross_entropy:cross_entropy", "Triton cross-entropy, online logsumexp over vocab blocks"),
}


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
        KernelProvider(
            op="attention",
            name="flex",
            impl="primus.turbo.attention_flex:attention",
            available=f"{_CHECK}:flex",
            priority=8,
            description="FlexAttention (Triton): causal, or within each document of a packed sample",
            features=frozenset({DOCUMENTS}),
        ),
        KernelProvider(
            op="attention",
            name="ring",
            impl="primus.turbo.context_parallel:attention",
            available=f"{_CHECK}:ring",
            priority=5,
            description="context-parallel attention: K/V around a ring of P2P sends, LSE merge (plain PyTorch)",
            features=frozenset({"context_parallel"}),
        ),
        *(
            KernelProvider(
                op=op,
                name="triton",
                impl=f"primus.turbo.triton.{impl}",
                available=f"{_CHECK}:triton_kernels",
                priority=20,
                description=description,
                features=frozenset({"linear_cross_entropy"}) if op == "cross_entropy" else frozenset(),
            )
            for op, (impl, description) in TRITON_OPS.items()
        ),
        KernelProvider(
            op="gemm",
            name="torchao",
            impl="primus.turbo.fp8.torchao_backend:convert_to_fp8",
            available=f"{_CHECK}:torchao_fp8",
            priority=20,
            description="FP8 training linears from torchao.float8 (CUDA sm_89+)",
        ),
        KernelProvider(
            op="gemm",
            name="fp8",
            impl="primus.turbo.fp8.linear:convert_to_fp8",
            available=f"{_CHECK}:fp8",
            priority=30,
            description="primus-turbo FP8 linear: torch._scaled_mm e4m3 / e5m2, Triton quantization",
        ),
    ]
