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
from collections.abc import Callable
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


def _split_config(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """``primus checkpoint import --from PATH key=value ...`` without a config: the first word is an override."""
    if config is not None and "=" in config and not Path(config).exists():
        return None, [config, *overrides]
    return config, overrides


def native_config(
    config: str | None,
    overrides: list[str],
    backend: str,
    model: dict | None,
    scratch: Path,
    registry=None,
    implied: tuple[str, ...] = (),
):
    """The run ``config`` + ``overrides`` on ``backend``, its model the checkpoint's where the checkpoint records one
    (``model``: model fields, as Megatron-LM's arguments give them), with the words the checkpoint ``implied`` below
    the user's. (The user's config, read at the world its parallel sizes need: what a resume reads; the config the
    import's engine is built with, for one process (a checkpoint of any layout loads under any other): no data read,
    whatever the engine writes as it builds in ``scratch``.)"""
    from primus.core.config.validate import validate_config
    from primus.core.hf.contract import OFFLINE_OVERRIDES
    from primus.core.launch.resolve import Resolved, resolve

    config, overrides = _split_config(config, overrides)
    if config is None and model is None:
        raise ValueError("the checkpoint records no model config: give CONFIG (a preset or YAML file naming its model)")
    overrides = [*implied, *overrides]

    def with_model(words: list[str], world: int) -> Resolved:
        res = resolve(config, [*words, f"backend.name={backend}"], world_size=world, registry=registry)
        if model is None:
            return res
        data = res.config.model_dump()
        data["model"] = {**data["model"], **model}
        cfg = validate_config(data, world_size=world, registry=res.registry)
        return Resolved(cfg, res.layers, res.registry, world)

    build = [*overrides, *OFFLINE_OVERRIDES, *IMPORT_OVERRIDES, f"logging.output_dir={scratch}"]
    return with_model(overrides, layout_world(config, overrides, registry)), with_model(build, 1)


def portable(res) -> dict:
    """``res``'s config as a file to resume from on any number of devices: what the world size decided and the
    user did not set (``parallel.dp_shard``, ``train.global_batch_size``) left to the resumed run's world."""
    data = res.config.model_dump(mode="json")
    set_ = {k for k, source in res.layers.sources.items() if source != "default"}
    if "parallel.dp_shard" not in set_:
        data["parallel"]["dp_shard"] = "auto"
    if "train.global_batch_size" not in set_:
        data["train"]["global_batch_size"] = None
    return data


def layout_world(config: str | None, overrides: list[str], registry=None) -> int:
    """The devices the parallel sizes a config sets need (tp · pp · cp · dp_replicate, · dp_shard where it is a
    number): the world the user's config is read at when nothing else says one (an import, written for a resume)."""
    from primus.core.config.loader import load_layers
    from primus.core.config.presets import resolver
    from primus.core.contracts.plugins import get_registry

    p = load_layers(config, overrides, resolver(registry or get_registry())).data.get("parallel") or {}
    world = 1
    for key in ("tp", "pp", "cp", "dp_replicate", "dp_shard"):
        if isinstance(p.get(key), int):
            world *= p[key]
    return world


def import_native_run(
    config: str | None,
    overrides: list[str],
    path: Path,
    out: str | None,
    to_hf: str | None,
    registry: Registry | None = None,
    weights_only: bool = False,
    say: Callable[[str], None] = log.info,
) -> Path | None:
    """``primus checkpoint import --from PATH`` (and ``export`` of such a checkpoint): the Primus checkpoint it
    wrote (None: only ``to_hf``). ``registry``: the installed plugins' when not given; ``say`` prints a line."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="primus-import-") as scratch:
        return _import_native(config, overrides, path, out, to_hf, registry, weights_only, Path(scratch), say)


def _import_native(config, overrides, path, out, to_hf, registry, weights_only, scratch: Path, say) -> Path | None:
    import shutil

    import yaml

    from primus.core.contracts.plugins import get_registry
    from primus.core.hf.contract import export_checkpoint
    from primus.core.run.checkpoints import NAMING
    from primus.core.run.rundir import RunFolder, checkpoint_root, output_dir

    registry = registry or get_registry()
    backend, found = recognised_or_refused(path, registry)
    say(f"found {found.what} ({backend})")
    user, build = native_config(config, overrides, backend, found.model, scratch / "build", registry, found.overrides)
    cfg = user.config
    name = NAMING.folder(Path(), found.step).name
    if out is None and to_hf:  # the Hugging Face folder alone: the import in the scratch folder
        done = import_native(build, found, scratch / name, weights_only=True)
        written = export_checkpoint(build.config, done, to_hf, registry=build.registry)
        say(f"exported {found.folder} -> {written}")
        return None
    resumable = found.optimizer and not weights_only
    if out is None:
        RunFolder(cfg).check_unused(resume=False)  # an earlier run's folder is not written into
        target = (checkpoint_root(cfg) if resumable else output_dir(cfg) / "imported") / name
    else:
        target = Path(out)
    created = not output_dir(cfg).exists()
    try:
        done = import_native(build, found, target, weights_only=weights_only)
    except BaseException:
        if created and out is None:
            shutil.rmtree(output_dir(cfg), ignore_errors=True)
        raise
    if out is None and not (output_dir(cfg) / "config.yaml").exists():  # export and --resume read it
        (output_dir(cfg) / "config.yaml").write_text(yaml.safe_dump(portable(user), sort_keys=False))
    say(f"imported {found.folder} -> {done} ({backend}, model {cfg.model.name}, step {found.step})")
    if resumable and out is None:
        say(f"continue it with: primus train {output_dir(cfg) / 'config.yaml'} --resume")
    elif not resumable:
        why = "--weights-only" if found.optimizer else found.optimizer_dropped or "the source holds no optimizer state"
        say(f"the weights alone ({why}): start a run from them with train.init_from={done}")
    if to_hf:
        written = export_checkpoint(cfg, done, to_hf, registry=user.registry)
        say(f"exported {done} -> {written}")
    return done
