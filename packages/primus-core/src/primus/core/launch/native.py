"""``primus checkpoint import --from PATH``: a checkpoint an engine's own trainer wrote becomes a Primus checkpoint.

Which backend reads it is the backends' to say (``BackendSpec.native``, :mod:`primus.core.contracts.native`): each
installed one is asked; the one that recognises it builds its engine in this process (one rank, the config's model
where the checkpoint records none), loads the checkpoint into it (the engine's ``load_native``: the model, and the
optimizer state where the source has one) and core commits the engine's state as any checkpoint of a run: a step
folder whose manifest records the source's step, its applied updates and where it came from. ``primus train CONFIG
--resume`` then continues it (the learning-rate schedule at the source's step); ``primus checkpoint export`` or
``--to-hf`` writes it as a Hugging Face folder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primus.core.contracts.engine import BackendSpec
from primus.core.contracts.errors import UserError
from primus.core.contracts.native import NativeCheckpoint, NativeFormat
from primus.core.contracts.protocols import load_ref
from primus.core.run import checkpoints as ckpt

if TYPE_CHECKING:
    from primus.core.contracts.plugins import Registry
    from primus.core.launch.resolve import Resolved

log = logging.getLogger("primus.import")

#: the engine an import builds: it reads no data (the run's own may not exist here), its initial weights are the
#: engine's own (the cheapest: the checkpoint's replace them), and it runs no step, so the fit check, which counts a
#: step's activations, does not refuse it (whether it fits is the build's to find: out of memory, one line)
IMPORT_OVERRIDES = (
    "data.source=mock",
    "eval.interval=0",
    "checkpoint.resume=false",
    "train.init_from=null",
    "train.init=engine",
    "train.allow_tight_fit=true",
)


def formats(registry: Registry) -> dict[str, NativeFormat]:
    """Backend name -> its :class:`NativeFormat`, for every backend that offers one."""
    found = {}
    for name, spec in registry.backends.items():
        if spec.native is not None:
            fmt = load_ref(spec.native)
            if not isinstance(fmt, NativeFormat):
                raise TypeError(
                    f"backend {name!r} ({spec.dist or 'unknown distribution'}): native={spec.native!r} is not a "
                    "primus.core.contracts.native.NativeFormat (source, expects, recognise(path))"
                )
            found[name] = fmt
    return found


def recognise(path: Path, registry: Registry) -> tuple[str, NativeCheckpoint] | None:
    """(backend name, what it recognised) of the first installed backend that recognises ``path``, or None."""
    for name, fmt in formats(registry).items():
        if (found := fmt.recognise(Path(path))) is not None:
            return name, found
    return None


def expected(registry: Registry) -> str:
    """What the installed backends import, for a refusal of a path none recognises."""
    said = [f"{fmt.expects} ({name})" for name, fmt in formats(registry).items()]
    return "; ".join(said) if said else "no installed backend imports its engine's own checkpoints"


def recognised_or_refused(path: Path, registry: Registry) -> tuple[str, NativeCheckpoint]:
    """What :func:`recognise` finds at ``path``; a :class:`UserError` in one line where it is nothing an installed
    backend imports (naming what they import) or where it is one that cannot be imported (naming why)."""
    if not path.exists():
        raise UserError(f"--from {path}: no such file or folder")
    if ckpt.read_manifest(path) is not None or ckpt.complete_checkpoints(path, ckpt.NAMING):
        raise UserError(
            f"--from {path}: a Primus checkpoint already; train from it (train.init_from={path}) or export it "
            "(primus checkpoint export)"
        )
    hit = recognise(path, registry)
    if hit is None:
        raise UserError(f"--from {path}: not a checkpoint an installed backend imports; expected {expected(registry)}")
    name, found = hit
    if found.problem:
        raise UserError(f"--from {path}: {found.what}: {found.problem}")
    return name, found


def record(found: NativeCheckpoint) -> dict[str, Any]:
    """The manifest's :data:`IMPORTED` record of ``found``."""
    return {"source": found.source, "path": str(found.folder.absolute()), "step": found.step, "what": found.what}


def import_native(res: Resolved, found: NativeCheckpoint, out: Path, *, weights_only: bool = False) -> Path:
    """Build ``res``'s engine in this process, load ``found`` into it (``load_native``) and commit its state at
    ``out`` (a step folder): the model and optimizer (resumable), or with ``weights_only`` the model alone (what
    ``train.init_from`` and an export read; always where the source holds no optimizer state). ``res`` is resolved
    for one process with :data:`IMPORT_OVERRIDES`."""
    from primus.core.contracts.engine import check_engine
    from primus.core.launch.rank import rank_context

    spec: BackendSpec = res.registry.backends[res.config.backend.name]
    weights_only = weights_only or not found.optimizer
    if out.exists():
        raise UserError(f"--out {out} exists; name a new folder (nothing was written)")
    cfg, ctx = rank_context(res, write_config=False)
    engine = spec.load_engine()(cfg, ctx)
    try:
        offers = check_engine(engine, spec.name)
        if "load_native" not in offers:
            raise UserError(f"backend {spec.name!r}: its engine cannot load the checkpoints it recognises")
        if weights_only and "save_weights" not in offers:
            raise UserError(f"backend {spec.name!r}: its engine cannot write its weights alone")
        log.info("loading %s (%s)", found.folder, found.what)
        engine.load_native(found, weights_only)
        man = ckpt.manifest(cfg, found.step, engine.layout, engine.distributions)
        man |= {"applied_steps": found.step, ckpt.IMPORTED: record(found)}
        if weights_only:
            man["weights_only"] = ckpt.weights_only(cfg, str(found.folder))
        write = engine.save_weights if weights_only else engine.save
        ckpt.atomic_save(out, man, 0, write, engine.barrier)
    finally:
        engine.close()
    return out
