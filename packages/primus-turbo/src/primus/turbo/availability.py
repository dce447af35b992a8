"""Can a provider run here? One check per provider, with the reason when it cannot.

Each check has the :class:`primus.core.protocols.KernelProvider` ``available`` signature:
``(device, **constraints) -> Availability`` with ``device`` one of ``"cuda"``, ``"rocm"``, ``"cpu"``
and the constraints core passes at selection (``dtype``: ``"bf16"``/``"fp16"``/``"fp32"`` or a
``torch.dtype``; ``head_dim``). A constraint that is not given is not checked. torch is imported
only once the device is a GPU, so the checks run on a machine without torch too.
"""

from __future__ import annotations

from typing import Any

from primus.core.protocols import Availability

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


def cudnn(device: str, *, dtype: Any = None, head_dim: int | None = None, **_: Any) -> Availability:
    if device != "cuda":
        return Availability(False, "no CUDA device" + (" (ROCm has no cuDNN)" if device == "rocm" else ""))
    import torch

    if not torch.backends.cudnn.is_available():
        return Availability(False, "this torch build has no cuDNN")
    if torch.cuda.get_device_capability() < (8, 0):
        return Availability(False, "cuDNN attention needs compute capability 8.0 or newer")
    return _verdict(shape_reason(dtype, head_dim))


def flash(device: str, *, dtype: Any = None, head_dim: int | None = None, **_: Any) -> Availability:
    if device not in ("cuda", "rocm"):
        return Availability(False, "no CUDA or ROCm device")
    import torch

    if device == "cuda" and torch.cuda.get_device_capability() < (8, 0):
        return Availability(False, "flash attention needs compute capability 8.0 or newer")
    return _verdict(shape_reason(dtype, head_dim))


def aiter(device: str, *, dtype: Any = None, head_dim: int | None = None, **_: Any) -> Availability:
    if device != "rocm":
        return Availability(False, "no ROCm device")
    import torch

    if not getattr(torch.version, "hip", None):
        return Availability(False, "torch is not a ROCm build")
    try:
        import aiter  # noqa: F401 - the import is the check
    except ImportError as exc:
        return Availability(False, f"aiter is not installed ({exc})")
    return _verdict(shape_reason(dtype, head_dim))


def triton_kernels(device: str, **_: Any) -> Availability:
    """The Triton kernels (primus.turbo.triton): any dtype and head size, on a CUDA or ROCm GPU."""
    if device not in ("cuda", "rocm"):
        return Availability(False, "Triton kernels need a CUDA or ROCm device")
    try:
        import triton  # noqa: F401 - the import is the check
    except ImportError as exc:
        return Availability(False, f"triton is not installed ({exc})")
    return Availability(True)
