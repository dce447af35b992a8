"""Can a provider run here? One check per provider, with the reason when it cannot.

Each check has the :class:`primus.core.contracts.protocols.KernelProvider` ``available`` signature:
``(device, **constraints) -> Availability`` with ``device`` one of ``"cuda"``, ``"rocm"``, ``"cpu"``
and the constraints core passes at selection (``dtype``: ``"bf16"``/``"fp16"``/``"fp32"`` or a
``torch.dtype``; ``head_dim``; ``cp``: the context-parallel size, which the attention checks answer: only a
provider with the ``"context_parallel"`` feature takes ``cp > 1``). A constraint that is not given is not checked. torch is imported
only once the device is a GPU, so the checks run on a machine without torch too.
"""

from __future__ import annotations

from typing import Any

from primus.core.contracts.protocols import Availability

HALF_DTYPES = ("fp16", "bf16")
MAX_HEAD_DIM = 256  # cuDNN, flash and AITER's CK kernels alike

_DTYPE_NAMES = {
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
}


def dtype_name(dtype: Any) -> str:
    """``"bf16"`` for ``"bf16"``, ``"bfloat16"`` or ``torch.bfloat16``; other spellings pass through."""
    text = str(dtype).removeprefix("torch.")
    return _DTYPE_NAMES.get(text, text)


def shape_reason(dtype: Any = None, head_dim: int | None = None) -> str:
    """Why half-precision attention kernels refuse these inputs ("" when they accept them)."""
    if dtype is not None and dtype_name(dtype) not in HALF_DTYPES:
        return f"dtype must be fp16 or bf16 (got {dtype_name(dtype)})"
    if head_dim is not None and (head_dim % 8 or head_dim > MAX_HEAD_DIM):
        return f"head_dim must be a multiple of 8 and <= {MAX_HEAD_DIM} (got {head_dim})"
    return ""


def _verdict(reason: str) -> Availability:
    return Availability(not reason, reason)


# KernelProvider.features entry of an attention provider whose impl also offers
# ``impl.context_parallel(q, k, v, *, group, causal, scale)`` for a load-balanced sequence shard
CONTEXT_PARALLEL = "context_parallel"


def cp_reason(cp: int | None) -> str:
    """Why a whole-sequence attention kernel refuses context parallelism ("" at cp 1 or when not given)."""
    if cp is None or cp <= 1:
        return ""
    return (
        f"attends over the whole sequence on one device; parallel.cp={cp} needs an attention provider with the "
        f"{CONTEXT_PARALLEL!r} feature (primus-turbo's 'ring')"
    )


def ring(device: str, *, cp: int | None = None, **_: Any) -> Availability:
    """primus.turbo.context_parallel: plain PyTorch and torch.distributed, any device, dtype and head size; offered
    only where the sequence is split (``cp > 1``), since a whole-sequence kernel is faster at cp 1."""
    if cp is None or cp <= 1:
        return Availability(
            False, f"ring attention is for a sequence split over parallel.cp > 1 ranks (cp={cp or 1} here)"
        )
    return Availability(True)


def cudnn(
    device: str, *, dtype: Any = None, head_dim: int | None = None, cp: int | None = None, **_: Any
) -> Availability:
    if device != "cuda":
        return Availability(False, "no CUDA device" + (" (ROCm has no cuDNN)" if device == "rocm" else ""))
    if why := cp_reason(cp):
        return Availability(False, why)
    import torch

    if not torch.backends.cudnn.is_available():
        return Availability(False, "this torch build has no cuDNN")
    if torch.cuda.get_device_capability() < (8, 0):
        return Availability(False, "cuDNN attention needs compute capability 8.0 or newer")
    return _verdict(shape_reason(dtype, head_dim))


def flash(
    device: str, *, dtype: Any = None, head_dim: int | None = None, cp: int | None = None, **_: Any
) -> Availability:
    if device not in ("cuda", "rocm"):
        return Availability(False, "no CUDA or ROCm device")
    if why := cp_reason(cp):
        return Availability(False, why)
    import torch

    if device == "cuda" and torch.cuda.get_device_capability() < (8, 0):
        return Availability(False, "flash attention needs compute capability 8.0 or newer")
    return _verdict(shape_reason(dtype, head_dim))


def aiter(
    device: str, *, dtype: Any = None, head_dim: int | None = None, cp: int | None = None, **_: Any
) -> Availability:
    if device != "rocm":
        return Availability(False, "no ROCm device")
    if why := cp_reason(cp):
        return Availability(False, why)
    import torch

    if not getattr(torch.version, "hip", None):
        return Availability(False, "torch is not a ROCm build")
    try:
        import aiter  # noqa: F401 - the import is the check
    except ImportError as exc:
        return Availability(False, f"aiter is not installed ({exc})")
    return _verdict(shape_reason(dtype, head_dim))


def flex(
    device: str, *, head_dim: int | None = None, cp: int | None = None, documents: bool = False, **_: Any
) -> Availability:
    """primus.turbo.attention_flex: FlexAttention compiled to Triton kernels (any dtype), on a CUDA or ROCm GPU, for
    document masking (``documents``): plain causal attention has its faster kernels."""
    if not documents:
        return Availability(
            False, "offered for document masking (data.document_mask); cuDNN, flash or SDPA serve causal attention"
        )
    if device not in ("cuda", "rocm"):
        return Availability(False, "FlexAttention has no backward on CPU (CUDA and ROCm only)")
    if why := cp_reason(cp):
        return Availability(False, why)
    if head_dim is not None and (head_dim < 16 or head_dim > MAX_HEAD_DIM or head_dim & (head_dim - 1)):
        return Availability(False, f"head_dim must be a power of two in 16..{MAX_HEAD_DIM} (got {head_dim})")
    try:
        import triton  # noqa: F401 - the import is the check (FlexAttention compiles through it)
    except ImportError as exc:
        return Availability(False, f"triton is not installed ({exc})")
    return Availability(True)


def triton_kernels(device: str, **_: Any) -> Availability:
    """The Triton kernels (primus.turbo.triton): any dtype and head size, on a CUDA or ROCm GPU."""
    if device not in ("cuda", "rocm"):
        return Availability(False, "Triton kernels need a CUDA or ROCm device")
    try:
        import triton  # noqa: F401 - the import is the check
    except ImportError as exc:
        return Availability(False, f"triton is not installed ({exc})")
    return Availability(True)


def grouped_mm(device: str, *, dtype: Any = None, **_: Any) -> Availability:
    """primus.turbo.grouped_gemm: torch's grouped_mm. CUDA: sm80+ and bf16 (its grouped kernels take no other
    dtype). ROCm: torch 2.10+ runs it on CK (gfx942 / gfx950) or a hipBLASLt loop (written against that API, not
    run here). CPU: any float dtype (torch's loop of matmuls, no host sync: equal to the reference loop)."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return Availability(False, f"torch {torch.__version__} has no grouped_mm (2.8 or newer)")
    if device == "cpu":
        return Availability(True)
    if dtype is not None and dtype_name(dtype) != "bf16":
        return Availability(False, f"torch's grouped_mm on a GPU takes bf16 (got {dtype_name(dtype)})")
    if not torch.cuda.is_available():
        return Availability(False, f"no {device} device visible to torch")
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 0):
        return Availability(False, "torch's grouped_mm needs compute capability 8.0 or newer")
    return Availability(True)


FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer


# AMD architectures whose matrix cores take FP8 through hipBLASLt's torch._scaled_mm: gfx942 (MI300X/MI325X, the
# fnuz formats) and gfx950 (MI350X/MI355X, the OCP ones)
FP8_ROCM_ARCHES = ("gfx942", "gfx950")


def rocm_arch() -> str:
    """The current AMD GPU's architecture, ``gfx942`` from ``gfx942:sramecc+:xnack-``."""
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName.split(":")[0]


def _fp8_reason(device: str) -> str:
    """Why ``torch._scaled_mm`` FP8 GEMMs cannot run on ``device`` ("" when they can)."""
    import torch

    if device == "rocm":  # written against torch's ROCm API; not run here (no AMD GPU)
        arch = rocm_arch()
        if arch not in FP8_ROCM_ARCHES:
            return f"{arch} has no FP8 GEMMs in torch._scaled_mm (ROCm: {', '.join(FP8_ROCM_ARCHES)})"
        return ""

    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float8 dtypes / torch._scaled_mm"
    if device == "cuda":
        cap = torch.cuda.get_device_capability()
        if cap < FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name()
            return f"{name} is compute capability {cap[0]}.{cap[1]}; FP8 GEMMs need 8.9 or newer (Ada, Hopper)"
        return ""
    return _cpu_scaled_mm_reason()


def _cpu_scaled_mm_reason() -> str:
    """torch._scaled_mm on CPU exists in some torch versions only: try one 16×16 product."""
    import torch

    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        return f"torch._scaled_mm does not run on CPU in torch {torch.__version__} ({str(exc).splitlines()[0]})"
    return ""


def fp8(
    device: str, *, mode: str = "tensorwise", scaling: str = "current", rocm_gemm: str = "hipblaslt", **_: Any
) -> Availability:
    """primus-turbo's FP8 linear (torch._scaled_mm): CUDA sm_89+, ROCm gfx942 / gfx950, or CPU where torch runs
    _scaled_mm there; ``rocm_gemm: aiter`` on ROCm also needs the aiter package."""
    from primus.turbo.fp8.recipe import delayed_rowwise_reason

    if mode == "rowwise" and scaling == "delayed":
        return Availability(False, delayed_rowwise_reason())
    if device == "rocm" and rocm_gemm == "aiter":
        try:
            import aiter  # noqa: F401 - the import is the check
        except ImportError as exc:
            return Availability(False, f"kernels.fp8_recipe.rocm_gemm=aiter: aiter is not installed ({exc})")
    return _verdict(_fp8_reason(device))


def torchao_fp8(
    device: str, *, mode: str = "tensorwise", scaling: str = "current", grad_dtype: str = "e5m2", **_: Any
) -> Availability:
    """torchao.float8's training linears: CUDA sm_89+ with torchao installed."""
    if device != "cuda":
        return Availability(False, "torchao.float8 training runs on CUDA GPUs only")
    try:
        from torchao.float8 import convert_to_float8_training  # noqa: F401 - the import is the check
    except ImportError as exc:
        return Availability(False, f"torchao is not installed ({exc})")
    from primus.turbo.fp8.recipe import Fp8Recipe
    from primus.turbo.fp8.torchao_backend import unsupported

    if mode == "rowwise" and scaling == "delayed":
        return Availability(False, "torchao.float8 has only dynamic (current) scaling")
    why = _fp8_reason(device) or unsupported(Fp8Recipe(mode=mode, grad_dtype=grad_dtype, scaling=scaling))
    return _verdict(why)
