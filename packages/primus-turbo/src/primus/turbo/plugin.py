"""The ``turbo`` entry point: the kernel providers primus-turbo registers.

Priorities order ``auto`` selection (highest available wins): AITER (ROCm) 30, cuDNN (CUDA) 20,
flash 10, flex 8, ring 5, core's plain SDPA 0. ``flex`` (FlexAttention, :mod:`primus.turbo.attention_flex`) alone of
them masks by document (the ``"documents"`` feature): with ``data.document_mask`` selection skips the others, so
``auto`` takes it on a GPU and core's SDPA on CPU. ``ring`` (context-parallel attention, :mod:`primus.turbo.context_parallel`)
declares the ``"context_parallel"`` feature and is available only under the constraint ``cp > 1``, which the other
attention providers refuse: with ``cp`` passed at selection, ``auto`` picks it exactly when the sequence is split. The Triton kernels (rms_norm, swiglu, rope, cross_entropy, moe_permute, moe_router) are 20, above
core's plain-PyTorch ones (0), on any CUDA or ROCm device with ``triton`` installed.

FP8 linears are ``gemm`` providers, chosen by ``kernels.fp8`` / ``fp8_recipe.implementation`` (not by
``auto`` over the ops): primus-turbo's ``fp8`` (30) before ``torchao`` (20, where torchao is installed). On the
H200, compiled, primus-turbo's linear ran 1-3% faster than torchao's on Llama 3.2 3B and 1B with an accumulated
batch (slower on 1B with one micro-batch per step; ``benchmarks/README.md``, session 5), and it alone offers
delayed scaling, rowwise with e5m2 gradients and megatron's linears.

``grouped_mm`` (20, :mod:`primus.turbo.grouped_gemm`) runs the experts of a mixture-of-experts layer as grouped
GEMMs over core's reference loop (0).
Their impl is the model swap ``convert_to_fp8(model, recipe, skip) -> names swapped``.
"""

from __future__ import annotations

from primus.core import hookimpl
from primus.core.contracts.protocols import DOCUMENTS, FP8_GROUPED_GEMM, KernelProvider

_CHECK = "primus.turbo.availability"

# (op, name, impl under primus.turbo, availability check in primus.turbo.availability, priority, description,
# features) of every provider; the Triton ones (TRITON_OPS) are added below
PROVIDERS = [
    # attention: the fastest kernel the device has; flex for document masks; ring for a sequence split over cp ranks
    ("attention", "aiter", "attention_aiter:attention", "aiter", 30, "AITER flash attention (ROCm, CK / asm v3 kernels)", ()),
    ("attention", "cudnn", "attention_sdpa:cudnn_attention", "cudnn", 20, "torch SDPA forced to the cuDNN backend (CUDA)", ()),
    ("attention", "flash", "attention_sdpa:flash_attention", "flash", 10, "torch SDPA forced to the flash backend (CUDA, ROCm)", ()),
    ("attention", "flex", "attention_flex:attention", "flex", 8, "FlexAttention (Triton): causal, or within each document of a packed sample", (DOCUMENTS,)),
    ("attention", "ring", "context_parallel:attention", "ring", 5, "context-parallel attention: K/V around a ring of P2P sends, LSE merge (plain PyTorch)", ("context_parallel",)),
    # mixture-of-experts
    ("grouped_gemm", "grouped_mm", "grouped_gemm:grouped_gemm", "grouped_mm", 20, "torch grouped_mm: every expert's GEMM in one launch (CUTLASS on CUDA, CK on ROCm)", ()),
    # FP8 linears (kernels.fp8)
    ("gemm", "torchao", "fp8.torchao_backend:convert_to_fp8", "torchao_fp8", 20, "FP8 training linears from torchao.float8 (CUDA sm_89+)", ()),
    ("gemm", "fp8", "fp8.linear:convert_to_fp8", "fp8", 30, "primus-turbo FP8 linear: torch._scaled_mm e4m3 / e5m2, Triton quantization", (FP8_GROUPED_GEMM,)),
]  # fmt: skip

# op -> (module:function under primus.turbo.triton, description)
TRITON_OPS = {
    "rms_norm": ("rms_norm:rms_norm", "Triton RMSNorm, one pass forward, persistent backward"),
    "swiglu": ("swiglu:swiglu", "Triton elementwise silu(gate) * up, fwd + bwd"),
    "rope": ("rope:rope", "Triton rotate-half RoPE, cos/sin row shared by the heads of a position"),
    "cross_entropy": ("cross_entropy:cross_entropy", "Triton cross-entropy, online logsumexp over vocab blocks"),
    "moe_permute": ("moe_permute:moe_permute", "Triton MoE token permute / weighted unpermute, row gathers fwd + bwd"),
    "moe_router": ("moe_router:moe_router", "Triton MoE router: scores, top-k and weights in one program per token"),
}


@hookimpl
def primus_kernels() -> list[KernelProvider]:
    triton = [
        (op, "triton", f"triton.{impl}", "triton_kernels", 20, description,
         ("linear_cross_entropy",) if op == "cross_entropy" else ())
        for op, (impl, description) in TRITON_OPS.items()
    ]  # fmt: skip
    return [
        KernelProvider(
            op=op,
            name=name,
            impl=f"primus.turbo.{impl}",
            available=f"{_CHECK}:{check}",
            priority=priority,
            description=description,
            features=frozenset(features),
        )
        for op, name, impl, check, priority, description, features in PROVIDERS + triton
    ]
