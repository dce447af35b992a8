"""A stand-in engine, for testing what runs around an engine without one: core's loop and checkpoint policy, the
lifecycle hooks, a logger plugin. Pure Python: no model, no process group; a run with it takes well under a second.

    from primus.core.run.testing import StandInEngine, registry
    reg = registry(("my_logger", my_logger_module))      # core + backend "stand-in" + your plugins
    run_rank(resolve("tiny-llama", ["backend.name=stand-in", ...], world_size=1, registry=reg))

It trains loss ``10 / step`` at grad norm 1, evaluates to ``float(step)`` of the weights it holds (so a test reads
which checkpoint was loaded), and checkpoints a state file and a weights file of :data:`WEIGHT_BYTES` (loading short
weights dies with EOFError, as torch's readers do over a truncated shard). ``backend.extra`` asks it to misbehave:
``signal_at: N`` sends this process SIGUSR1 during step N (the step completes), ``fail_at: N`` raises during step N,
``fail_save_at: N`` dies writing step N's checkpoint after its weights file. :attr:`StandInEngine.calls` records
what the loop asked, in order: ``("train", step)``, ``("eval", step, samples, batches)``, ``("load", step)``,
``("load_native", step, weights_only)``.

Its "own trainer" writes folders with :data:`TRAINER_FILE` (``{"step": N, "optimizer": bool, "model": {...} or
null}``), which its native format recognises (:class:`StandInFormat`) and its engine loads (``load_native``), for
tests of ``primus checkpoint import --from``; ``"broken": "why"`` in the file makes it one that cannot be imported.

:func:`built_once` makes a slow fixture (a reference training run) once for a whole pytest run, pytest-xdist workers
included.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from primus.core import hookimpl
from primus.core.contracts.engine import BackendSpec, StepResult
from primus.core.contracts.native import NativeCheckpoint
from primus.core.contracts.plugins import Registry, build_plugin_manager
from primus.core.data.cache import build_once

NAME = "stand-in"
WEIGHT_BYTES = 3 * 2**16


def weights(step: int) -> bytes:
    """The weights file of the stand-in at ``step``."""
    return bytes((step * 7 + i) % 251 for i in range(WEIGHT_BYTES))


class StandInEngine:
    layout = {"world": 1}
    distributions = ("primus-core",)
    calls: list[tuple] = []

    def __init__(self, cfg: Any, ctx: Any) -> None:
        extra = cfg.backend.extra
        self.model_parts: list[Any] = []
        self.step = 0
        self.signal_at, self.fail_at = extra.get("signal_at"), extra.get("fail_at")
        self.fail_save_at = extra.get("fail_save_at")

    def train_step(self, step: int, lr: float, gate: Any) -> StepResult:
        self.calls.append(("train", step))
        if step == self.fail_at:
            raise RuntimeError(f"engine failed at step {step}")
        if step == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        self.step = step
        applied = gate(10.0 / step, 1.0)
        return StepResult(loss=10.0 / step, grad_norm=1.0, applied=applied)

    def evaluate(self, samples: Any, batches: int) -> float:
        self.calls.append(("eval", self.step, len(samples), batches))
        return float(self.step)

    def save(self, folder: Path) -> None:
        (folder / "weights.bin").write_bytes(weights(self.step))
        if self.step == self.fail_save_at:
            raise RuntimeError("killed mid-save")
        (folder / "state.json").write_text(json.dumps({"step": self.step}))

    def save_weights(self, folder: Path) -> None:
        (folder / "weights.bin").write_bytes(weights(self.step))

    def load_native(self, found: NativeCheckpoint, weights_only: bool) -> None:
        self.step = json.loads((found.folder / TRAINER_FILE).read_text())["step"]
        self.calls.append(("load_native", self.step, weights_only))

    def load(self, folder: Path) -> None:
        if len((folder / "weights.bin").read_bytes()) < WEIGHT_BYTES:
            raise EOFError(f"{folder / 'weights.bin'} is short")
        self.step = json.loads((folder / "state.json").read_text())["step"]
        self.calls.append(("load", self.step))

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


TRAINER_FILE = "stand-in-trainer.json"


class StandInFormat:
    """The stand-in's own trainer's checkpoints: a folder holding :data:`TRAINER_FILE`."""

    source = "the stand-in trainer"
    expects = f"a stand-in trainer checkpoint (a folder with {TRAINER_FILE})"

    def recognise(self, path: Path) -> NativeCheckpoint | None:
        if not (path / TRAINER_FILE).is_file():
            return None
        record = json.loads((path / TRAINER_FILE).read_text())
        what = f"stand-in trainer checkpoint, step {record['step']}"
        return NativeCheckpoint(
            self.source, path, record["step"], what, record.get("broken"), record.get("model"), record["optimizer"]
        )


class _Backend:
    @staticmethod
    @hookimpl
    def primus_backends() -> list[BackendSpec]:
        return [
            BackendSpec(
                NAME,
                "a pure-Python stand-in engine (primus.core.run.testing)",
                engine=StandInEngine,
                native=StandInFormat(),
            )
        ]


def registry(*plugins: tuple[str, Any]) -> Registry:
    """Core's own plugin, the ``stand-in`` backend and ``plugins`` ((name, module or object) pairs); no installed
    plugin is loaded when ``PRIMUS_DISABLE_PLUGIN_AUTOLOAD`` is set."""
    return Registry(build_plugin_manager(extra_plugins=[("stand-in", _Backend), *plugins]))


def built_once(tmp_path_factory: Any, name: str, build: Callable[[Path], object]) -> Path:
    """``build(folder)`` once for the whole pytest run (``tmp_path_factory``: pytest's), the folder shared by its
    pytest-xdist workers (each has its own session, so a session fixture two workers use was built twice): the first
    builds under core's data-cache lock (:func:`~primus.core.data.cache.build_once`), the others wait and read it.
    Tests copy what they change."""
    base = tmp_path_factory.getbasetemp()
    return build_once((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name, build)
