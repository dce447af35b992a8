"""What a plugin hands core besides a backend (:mod:`primus.core.contracts.engine` holds that contract): kernel providers,
strategies, a config's refusals.

Specs are plain frozen dataclasses (the TorchTitan ``TrainSpec`` pattern). Anything heavy (the
engine, torch, a vendor library) is named as an ``"module:attr"`` string and imported only when it
is used (the Megatron ``ModuleSpec`` pattern), so listing plugins never imports an engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KERNEL_OPS = (
    "attention",
    "rms_norm",
    "swiglu",
    "cross_entropy",
    "rope",
    "grouped_gemm",
    "moe_permute",
    "moe_router",
    "gemm",
)


def load_ref(ref: str | Callable[..., Any]) -> Any:
    """Resolve ``"package.module:attr.sub"`` to the object (callables pass through)."""
    if not isinstance(ref, str):
        return ref
    module_name, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class ConfigIssue:
    """One reason a config is refused: the key path, the bad value, and what is allowed."""

    path: str
    message: str
    value: Any = None
    allowed: str | None = None

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}"
        if self.value is not None and repr(self.value) not in self.message:
            text += f" (got {self.value!r})"
        if self.allowed:
            text += f"; allowed: {self.allowed}"
        return text


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


#: KernelProvider.features entry of an attention provider whose impl takes ``documents=[b, s]`` (document-aware
#: attention in packed samples, ``data.document_mask``: :mod:`primus.core.kernels.documents`)
DOCUMENTS = "documents"

#: KernelProvider.features entry of an attention provider whose impl has ``impl.context_parallel(q, k, v, *, group,
#: causal=True, scale=None)``: attention over a sequence split across ``group`` (``parallel.cp``), each rank holding
#: chunks ``r`` and ``2·cp-1-r`` of ``2·cp``, q ``[b, h, s_local, d]``
CONTEXT_PARALLEL = "context_parallel"

#: KernelProvider.features entry of an FP8 (``gemm``) provider whose impl offers ``impl.grouped_gemm_for(recipe)``: the
#: ``grouped_gemm`` contract with FP8 operands, which a mixture-of-experts model's experts run on under ``kernels.fp8``
FP8_GROUPED_GEMM = "fp8_grouped_gemm"


@dataclass(frozen=True)
class KernelProvider:
    """One implementation of one op.

    ``available(device: str, **constraints) -> Availability`` says whether it runs here (device is
    ``"cuda"``, ``"rocm"`` or ``"cpu"``; constraints such as ``dtype`` or ``head_dim`` may be
    passed). ``impl`` is the callable or module the backends use, named lazily. ``features`` names what
    it offers beyond the op's contract, for those that plan without loading it (the planner reads
    ``"linear_cross_entropy"``: a cross-entropy that also takes the output projection, so the logits are
    never materialised).
    """

    op: str
    name: str
    impl: str | Callable[..., Any]
    available: str | Callable[..., Availability]
    priority: int = 0
    description: str = ""
    dist: str = ""
    features: frozenset[str] = frozenset()

    def check(self, device: str, **constraints: Any) -> Availability:
        try:
            return load_ref(self.available)(device, **constraints)
        except ImportError as exc:  # an optional dependency is missing
            return Availability(False, f"import failed: {exc}")

    def load(self) -> Any:
        return load_ref(self.impl)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes by category (parameters, gradients, optimizer, activations, buffers)."""

    parts: dict[str, float]

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))


@dataclass(frozen=True)
class StrategySpec:
    """A parallel strategy.

    ``fill(parallel: dict, world_size: int, cfg) -> dict`` returns the parallel section with its
    ``auto`` fields decided; ``estimate(cfg, world_size) -> MemoryEstimate`` the per-device memory.
    """

    name: str
    description: str
    fill: str | Callable[..., dict[str, Any]]
    estimate: str | Callable[..., MemoryEstimate] | None = None
    dist: str = ""
