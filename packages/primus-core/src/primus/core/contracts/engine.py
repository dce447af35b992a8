"""The backend contract, in one file: what a backend registers (:class:`BackendSpec`), what its engine builder gets
(:class:`RunContext`), and what ``BackendSpec.engine`` builds and core's loop drives (:class:`Engine`, its
capabilities, :class:`StepResult`).

A backend registers ``engine``: an :data:`EngineBuilder`, ``(cfg, ctx) -> Engine``, named lazily as
``"package.module:build"`` so that listing plugins never imports the engine. The engine it returns has the members
of :class:`Engine`; the loop checks them once, right after the build (:func:`check_engine`), and refuses an engine
that lacks one, naming the backend and the member. What an engine may offer besides is declared here too, one
runtime-checkable Protocol per capability (:data:`CAPABILITY_PROTOCOLS`), which an adapter lists among its bases: the
loop asks :func:`check_engine`'s answer, never the engine, whether it has one. ``nox -s lint`` type-checks this file
and both adapters' engines against it (mypy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from primus.core.contracts.errors import UserError
from primus.core.contracts.protocols import ConfigIssue, KernelProvider, load_ref

if TYPE_CHECKING:
    from primus.core.config.schema import PrimusConfig
    from primus.core.contracts.native import NativeCheckpoint


@dataclass
class StepResult:
    """What one optimizer step gives the loop."""

    loss: float  # mean token loss over the global batch, the same on every rank; NaN if any rank's is
    grad_norm: float | None  # before clipping; None where the engine has none (no optimizer step ran)
    applied: bool = True  # False when the health gate refused the update
    tokens: int | None = None  # tokens of the global batch (default: global_batch_size × seq_len)


#: ``gate(loss, grad_norm) -> bool``: core's health check between the gradient norm and the update (False: drop
#: the update; it raises when the run must stop)
Gate = Callable[[float, "float | None"], bool]


class Engine(Protocol):
    """A backend's adapter: its engine's native objects behind the calls core's loop makes. Every member here is
    required (:data:`REQUIRED`); the optional ones are :data:`CAPABILITIES`."""

    model_parts: list[Any]  # the model modules on this rank (one per pipeline chunk)
    layout: dict[str, int]  # the parallel layout, recorded in each checkpoint's manifest
    distributions: tuple[str, ...]  # whose versions each checkpoint's manifest records

    def train_step(self, step: int, lr: float, gate: Gate) -> StepResult:
        """Run step ``step`` (1-based) over its global batch at learning rate ``lr``. Once the loss and grad norm
        are known and before the update, call ``gate(loss, grad_norm)``: False means drop the update
        (parameters and optimizer state unchanged); it raises when the run must stop."""
        ...

    def save(self, folder: Path) -> None:
        """Write this rank's state (model, optimizer, anything else to resume) into ``folder`` (it exists)."""
        ...

    def load(self, folder: Path) -> None:
        """Load the state that :meth:`save` wrote (possibly from another layout) on this rank."""
        ...

    def barrier(self) -> None: ...

    def close(self) -> None:
        """Release the engine (process groups, files); called once, also after an error."""
        ...


#: ``(cfg, ctx) -> Engine``: what ``BackendSpec.engine`` names
EngineBuilder = Callable[["PrimusConfig", "RunContext"], Engine]

REQUIRED = ("model_parts", "layout", "distributions", "train_step", "save", "load", "barrier", "close")
METHODS = frozenset({"train_step", "save", "load", "barrier", "close"})

# What an engine may offer besides :class:`Engine`'s members: each capability a runtime-checkable Protocol of one member
# (declared once, here; an adapter lists the ones it implements among its bases, so a type checker holds its
# signatures to them), and what core does with it (the Protocol's docstring). An engine without ``evaluate`` refuses
# ``eval.interval``.


@runtime_checkable
class Evaluates(Protocol):
    """evaluate(samples, batches) -> float: forward only, the mean token loss over the first ``batches`` global batches
    of ``samples`` (read in order: batch b is samples [b·G, (b+1)·G), each data-parallel rank its contiguous slice, as
    in training), the same value on every rank; no gradient, optimizer state or training data position touched
    (primus.core.run.evaluation)"""

    def evaluate(self, samples: Any, batches: int) -> float: ...


@runtime_checkable
class RoutesExperts(Protocol):
    """expert_routers() -> list[(global layer index, router module, counts)]: a mixture-of-experts engine's routers,
    with a function from a router's output to its tokens per expert (the expert-load metrics,
    primus.core.run.expert_load)"""

    def expert_routers(self) -> list[tuple[int, Any, Any]]: ...


@runtime_checkable
class IntervalMetrics(Protocol):
    """interval_metrics() -> dict[str, float]: metrics defined in core that only the engine can measure (e.g.
    moe_aux_loss), over the steps since the previous call; called on every rank at each logging step (it may reduce
    over ranks)"""

    def interval_metrics(self) -> dict[str, float]: ...


@runtime_checkable
class LoadsNative(Protocol):
    """load_native(checkpoint, weights_only) -> None: load a checkpoint the engine's own trainer wrote (a
    primus.core.contracts.native.NativeCheckpoint its backend's BackendSpec.native recognised) into the built engine,
    resharded to its layout: the model, and unless ``weights_only`` the optimizer state where the checkpoint holds one
    (``primus checkpoint import --from``)"""

    def load_native(self, checkpoint: NativeCheckpoint, weights_only: bool) -> None: ...


@runtime_checkable
class SavesWeights(Protocol):
    """save_weights(folder) -> None: this rank's share of the model weights alone (no optimizer or data state) into
    ``folder``, in the form ``load`` and ``train.init_from`` read on any layout; core commits the folder with its
    manifest (``train.save_initial``)"""

    def save_weights(self, folder: Path) -> None: ...


@runtime_checkable
class Summarises(Protocol):
    """attribute, dict: what the run's summary takes over (e.g. the kernels the engine applied)"""

    summary: dict[str, Any]


#: capability name -> its Protocol
CAPABILITY_PROTOCOLS: dict[str, type] = {
    "evaluate": Evaluates,
    "expert_routers": RoutesExperts,
    "interval_metrics": IntervalMetrics,
    "load_native": LoadsNative,
    "save_weights": SavesWeights,
    "summary": Summarises,
}
#: capability name -> what it is and what core does with it (the Protocol's docstring)
CAPABILITIES = {name: " ".join((proto.__doc__ or "").split()) for name, proto in CAPABILITY_PROTOCOLS.items()}
ATTRIBUTES = frozenset({"summary"})


def check_engine(engine: Any, backend: str) -> frozenset[str]:
    """The :data:`CAPABILITIES` ``engine`` offers; a :class:`UserError` naming ``backend`` and each required member
    it lacks (a method that is not callable counts as lacking)."""
    missing = [
        name
        for name in REQUIRED
        if not hasattr(engine, name) or (name in METHODS and not callable(getattr(engine, name)))
    ]
    if missing:
        raise UserError(
            f"backend {backend!r}: its engine ({type(engine).__name__}) lacks {', '.join(missing)} of the engine "
            "contract (primus.core.contracts.engine.Engine)"
        )
    return capabilities(engine)


def capabilities(engine: Any) -> frozenset[str]:
    """The :data:`CAPABILITIES` ``engine`` offers: the Protocols it satisfies, each with its method callable or its
    attribute set."""
    return frozenset(
        name
        for name, proto in CAPABILITY_PROTOCOLS.items()
        if isinstance(engine, proto)
        and (getattr(engine, name) is not None if name in ATTRIBUTES else callable(getattr(engine, name)))
    )


# -- what a backend registers, and what its engine builder gets besides the config --------------------------------


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
    # the engine's facts for the planner (primus.core.planner.engine_profile.EngineProfile); None: the planner's defaults
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
