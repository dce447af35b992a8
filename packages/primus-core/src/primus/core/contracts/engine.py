"""The engine contract, in one file: what a backend's ``BackendSpec.engine`` builds and core's loop drives.

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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from primus.core.contracts.errors import UserError

if TYPE_CHECKING:
    from primus.core.config.schema import PrimusConfig
    from primus.core.contracts.native import NativeCheckpoint
    from primus.core.contracts.protocols import RunContext


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
