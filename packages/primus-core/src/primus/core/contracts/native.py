"""Checkpoints an engine's own trainer wrote (Megatron-LM's ``iter_NNNNNNN``, TorchTitan's ``step-N``): what a backend
says about one it recognises, and what it implements to recognise them.

A backend offers this with ``BackendSpec.native``: a ``"module:attr"`` naming a :class:`NativeFormat`, which reads
file names and small metadata only (no engine import), so every installed backend can be asked about a path. Its
engine loads what it recognised (the engine capability ``load_native``, :mod:`primus.core.contracts.engine`);
``primus checkpoint import --from PATH`` builds that engine in one process, loads the checkpoint and commits it as a
Primus checkpoint (:mod:`primus.core.launch.native`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class NativeCheckpoint:
    """A checkpoint a backend's :class:`NativeFormat` recognised."""

    source: str  # who wrote it, as its users call it ("Megatron-LM", "TorchTitan")
    folder: Path  # the checkpoint folder itself (a root resolved to its newest checkpoint)
    step: int  # the iteration / step its run had reached (its updates applied)
    what: str  # one line for a person: what it is, e.g. "Megatron-LM torch_dist checkpoint, iteration 2, TP 2"
    # why Primus cannot import it, with what is expected instead (None: it can)
    problem: str | None = None
    # model config fields (primus.core.config.schema.ModelConfig) the checkpoint records (Megatron-LM's args); None:
    # it records none, and the config given to the import names the model
    model: dict[str, Any] | None = None
    optimizer: bool = False  # whether it holds optimizer state an import carries over
    # it holds optimizer state that cannot be carried over: why, with what would (None: none dropped)
    optimizer_dropped: str | None = None
    # ``key=value`` words the checkpoint implies beside its model (``train.precision=fp32``), applied below the user's
    overrides: tuple[str, ...] = ()
    # anything else the engine's load_native needs from the recognition (key names, the layout it was saved at)
    details: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class NativeFormat(Protocol):
    """What ``BackendSpec.native`` names."""

    source: str  # as NativeCheckpoint.source
    expects: str  # what it reads, for a refusal of a path none recognises: "a Megatron-LM torch_dist checkpoint (...)"

    def recognise(self, path: Path) -> NativeCheckpoint | None:
        """``path`` as a checkpoint of this format (a problem set where it is one that cannot be imported, e.g. an
        older file format), or None where it is none of this format's. Reads file names and small metadata only."""
        ...
