"""Contracts between core and plugins: what a backend, kernel provider and strategy look like.

Specs are plain frozen dataclasses (the TorchTitan ``TrainSpec`` pattern). Anything heavy (the
engine, torch, a vendor library) is named as an ``"module:attr"`` string and imported only when it
is used (the Megatron ``ModuleSpec`` pattern), so listing plugins never imports an engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from primus.core.config.schema import PrimusConfig
    from primus.core.contracts.engine import EngineBuilder

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
class BackendSpec:
    """A training engine Primus can drive.

    ``engine`` (required) builds, on each rank, the adapter core's training loop drives: an
    :data:`~primus.core.contracts.engine.EngineBuilder`, ``(cfg, ctx) -> Engine``
    (:class:`primus.core.contracts.engine.Engine`: steps, learning rate, health, metrics, checkpoints, evaluation
    and resume are then core's). ``validate(cfg, world_size) -> list[ConfigIssue]`` refuses what the engine cannot
    do, before any device work. Each is an object or a lazy ``"module:attr"`` name.
    """

    name: str
    description: str
    engine: str | EngineBuilder
    validate: str | Callable[[PrimusConfig, int], list[ConfigIssue]] | None = None
    model_families: frozenset[str] = frozenset()
    priority: int = 0
    dist: str = ""  # filled in by the plugin manager
    # Hugging Face import/export: an object with the methods of primus.core.hf.contract.HFInterop (named lazily)
    hf: str | Callable[..., Any] | None = None
    # the engine's facts for the planner (primus.core.planner.profile.EngineProfile); None: the planner's defaults
    planner: str | Any | None = None
    # the checkpoints its engine's own trainer writes, recognised for import: a
    # primus.core.contracts.native.NativeFormat (named lazily); its engine then offers load_native
    native: str | Any | None = None

    def __post_init__(self) -> None:
        if self.engine is None or not (isinstance(self.engine, str) or callable(self.engine)):
            raise TypeError(
                f"backend {self.name!r}: BackendSpec.engine must be an engine builder (cfg, ctx) -> Engine or its "
                f"'module:attr' name, got {self.engine!r}"
            )

    def load_engine(self) -> EngineBuilder:
        return load_ref(self.engine)

    def load_validate(self) -> Callable[..., Any] | None:
        return load_ref(self.validate) if self.validate is not None else None


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


@dataclass
class RunInfo:
    """What lifecycle hooks learn about a run."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    device: str = "cpu"
    backend: str = ""
    output_dir: str = ""
    kernels: dict[str, str] = field(default_factory=dict)
    num_params: int = 0
    flops_per_token: float = 0.0
    peak_flops: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunContext:
    """What a backend's engine builder gets besides the config: who this rank is, the kernels chosen for it, whether
    it resumes, and the evaluation samples.

    Core's loop reports through these methods, never by calling hooks itself: ``model_ready`` once the engine is
    built, ``train_step`` after every optimizer step (``primus_on_optimizer_step``), ``step_end`` at each logging
    interval with its metrics (``primus_on_log``).
    """

    info: RunInfo
    hooks: Any  # pluggy HookRelay (keyword arguments only): hooks.primus_on_log(step=..., metrics=..., info=...)
    kernels: dict[str, KernelProvider] = field(default_factory=dict)
    resume: bool = False
    config: Any = None  # the validated PrimusConfig, for the hooks that take it
    eval_samples: Any = None  # the evaluation samples, built once before the run folder (primus.core.run.evaluation)

    def model_ready(self, model_parts: list[Any]) -> None:
        self.hooks.primus_on_model_ready(config=self.config, model_parts=list(model_parts), info=self.info)

    def train_step(self, step: int) -> None:
        """After every optimizer step: ``primus_on_optimizer_step``."""
        self.hooks.primus_on_optimizer_step(step=step, info=self.info)

    def step_end(self, step: int, metrics: dict[str, float]) -> None:
        """At each logging interval: ``primus_on_log``."""
        self.hooks.primus_on_log(step=step, metrics=metrics, info=self.info)


def validate_with(spec: BackendSpec, cfg: PrimusConfig, world_size: int) -> list[ConfigIssue]:
    fn = spec.load_validate()
    return list(fn(cfg, world_size=world_size)) if fn else []
