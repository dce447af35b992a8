"""``primus checkpoint ...``: Hugging Face import / export for either backend, and verifying a checkpoint's files
(mounted by :mod:`primus.core.cli.app`).

Importing this module imports neither torch nor an engine: the work is imported when a command runs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

checkpoint_app = typer.Typer(
    help="Hugging Face import / export of checkpoints; verifying their files.", no_args_is_help=True
)
_out = Console(soft_wrap=True)  # one line a message: paths copy whole
_err = Console(stderr=True, soft_wrap=True)
log = logging.getLogger("primus.hf")


def fail(exc: Exception) -> typer.Exit:
    _err.print(f"error: {exc}", style="red", highlight=False, markup=False, soft_wrap=True)
    return typer.Exit(2)


def config_with_hf_model(config: str, overrides: list[str], hf_dir: str, check_plugins: bool = True):
    """The resolved config of ``config`` + ``overrides`` whose model is the HF folder's architecture, and whose
    tokenizer is the folder's (unless the user set ``data.tokenizer``, as with ``train.init_from``).
    ``check_plugins=False``: without the checks that need the installed backends (as ``resolve`` has it)."""
    import json

    from primus.core.config.validate import resolve_parallel, validate_config
    from primus.core.hf.config import model_fields_from_hf
    from primus.core.launch.resolve import resolve
    from primus.core.run.init_from import settle_mtp, takes_model_tokenizer

    res = resolve(config, overrides, check_plugins=check_plugins)
    hf_json = Path(hf_dir) / "config.json"
    if not hf_json.is_file():
        from primus.core.hf.safetensors_io import HFCheckpointError

        raise HFCheckpointError(f"--from-hf {hf_dir}: no config.json there (not a Hugging Face model folder)")
    fields = model_fields_from_hf(json.loads(hf_json.read_text()), name=Path(hf_dir).absolute().name)
    data = res.config.model_dump()
    changed = [k for k, v in fields.items() if data["model"].get(k) != v and k != "name"]
    if changed:
        log.info("model from %s: %s", hf_json, ", ".join(f"{k}={fields[k]!r}" for k in changed))
    if note := settle_mtp(fields, Path(hf_dir), res.layers.sources):  # as train.init_from takes model.mtp
        log.info("%s", note)
    if isinstance(fields.get("moe"), dict) and isinstance(data["model"].get("moe"), dict):
        fields["moe"] = {**data["model"]["moe"], **fields["moe"]}  # the run's balancing / capacity stay
    data["model"] = {**data["model"], **fields}
    if (Path(hf_dir) / "tokenizer.json").is_file() and takes_model_tokenizer(res.layers.sources.get("data.tokenizer")):
        data["data"]["tokenizer"] = str(Path(hf_dir).absolute())  # as train.init_from takes it: the embedding's own
    cfg = validate_config(data, world_size=res.world_size, registry=res.registry if check_plugins else None)
    return resolve_parallel(cfg, res.world_size)


@checkpoint_app.command("import")
def import_(
    config: Annotated[
        str | None,
        typer.Argument(
            help="a YAML file or a preset name: backend, parallel layout, precision (with --from: optional "
            "where the checkpoint records its model)"
        ),
    ] = None,
    overrides: Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides, applied last")] = None,
    from_hf: Annotated[str, typer.Option("--from-hf", help="Hugging Face folder: config.json + *.safetensors")] = "",
    from_: Annotated[
        str,
        typer.Option(
            "--from",
            help="a checkpoint an engine's own trainer wrote: Megatron-LM's (its folder with "
            "latest_checkpointed_iteration.txt, or one iter_NNNNNNN) or TorchTitan's (a step-N folder)",
        ),
    ] = "",
    out: Annotated[
        str | None,
        typer.Option(
            "--out",
            help="checkpoint folder (default: --from-hf <output_dir>/hf_import; --from <output_dir>/checkpoints/"
            "step_N, which primus train --resume continues, or <output_dir>/imported/step_N without optimizer state)",
        ),
    ] = None,
    to_hf: Annotated[
        str | None, typer.Option("--to-hf", help="with --from: also (without --out: only) write a Hugging Face folder")
    ] = None,
    weights_only: Annotated[
        bool, typer.Option("--weights-only", help="with --from: the model alone, for train.init_from (no optimizer)")
    ] = False,
) -> None:
    """Hugging Face weights (--from-hf), or an engine's own checkpoint (--from), -> a Primus checkpoint."""
    from primus.core.config.errors import ConfigError
    from primus.core.contracts.errors import UserError
    from primus.core.hf.contract import import_checkpoint
    from primus.core.hf.safetensors_io import folder_problem
    from primus.core.run.rundir import output_dir

    if bool(from_hf) == bool(from_):
        raise fail(
            ValueError("give one of --from-hf DIR (a Hugging Face folder) and --from PATH (an engine's own checkpoint)")
        )
    if from_:
        try:
            import_native_cli(config, overrides or [], Path(from_), out, to_hf, weights_only=weights_only)
        except (ConfigError, UserError, ValueError) as exc:
            raise fail(exc) from None
        return
    if to_hf or weights_only:
        raise fail(ValueError("--to-hf and --weights-only go with --from (a Hugging Face folder is weights already)"))
    if config is None:
        raise fail(ValueError("--from-hf: give CONFIG (the backend, parallel layout and precision to import for)"))
    if problem := folder_problem(Path(from_hf)):  # before the config: the cheapest thing to get wrong
        raise fail(ValueError(f"--from-hf {from_hf}: {problem}"))
    try:
        cfg = config_with_hf_model(config, overrides or [], from_hf)
        target = Path(out) if out else output_dir(cfg) / "hf_import"
        path = import_checkpoint(cfg, from_hf, target)
    except (ConfigError, UserError) as exc:
        raise fail(exc) from None
    if int(os.environ.get("RANK", "0")) == 0:
        _out.print(f"imported {from_hf} -> {path} ({cfg.backend.name}, model {cfg.model.name})", highlight=False)


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
    from primus.core.launch.native import IMPORT_OVERRIDES
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


def import_native_cli(
    config: str | None,
    overrides: list[str],
    path: Path,
    out: str | None,
    to_hf: str | None,
    registry=None,
    weights_only: bool = False,
) -> Path | None:
    """``primus checkpoint import --from PATH`` (and ``export`` of such a checkpoint): the Primus checkpoint it
    wrote (None: only ``to_hf``). ``registry``: the installed plugins' when not given."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="primus-import-") as scratch:
        return _import_native(config, overrides, path, out, to_hf, registry, weights_only, Path(scratch))


def _import_native(config, overrides, path, out, to_hf, registry, weights_only, scratch: Path) -> Path | None:
    import shutil

    import yaml

    from primus.core.contracts.plugins import get_registry
    from primus.core.hf.contract import export_checkpoint
    from primus.core.launch.native import import_native, recognised_or_refused
    from primus.core.run.checkpoints import NAMING
    from primus.core.run.rundir import RunFolder, checkpoint_root, output_dir

    registry = registry or get_registry()
    backend, found = recognised_or_refused(path, registry)
    _out.print(f"found {found.what} ({backend})", highlight=False)
    user, build = native_config(config, overrides, backend, found.model, scratch / "build", registry, found.overrides)
    cfg = user.config
    name = NAMING.folder(Path(), found.step).name
    if out is None and to_hf:  # the Hugging Face folder alone: the import in the scratch folder
        done = import_native(build, found, scratch / name, weights_only=True)
        written = export_checkpoint(build.config, done, to_hf, registry=build.registry)
        _out.print(f"exported {found.folder} -> {written}", highlight=False)
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
    _out.print(
        f"imported {found.folder} -> {done} ({backend}, model {cfg.model.name}, step {found.step})", highlight=False
    )
    if resumable and out is None:
        _out.print(f"continue it with: primus train {output_dir(cfg) / 'config.yaml'} --resume", highlight=False)
    elif not resumable:
        why = "--weights-only" if found.optimizer else found.optimizer_dropped or "the source holds no optimizer state"
        _out.print(f"the weights alone ({why}): start a run from them with train.init_from={done}", highlight=False)
    if to_hf:
        written = export_checkpoint(cfg, done, to_hf, registry=user.registry)
        _out.print(f"exported {done} -> {written}", highlight=False)
    return done


@checkpoint_app.command("export")
def export(
    checkpoint: Annotated[str, typer.Argument(help="a checkpoint folder, or a folder of them (the newest is taken)")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides of the run's config")] = None,
    to_hf: Annotated[str, typer.Option("--to-hf", help="Hugging Face folder to write")] = ...,
    config: Annotated[
        str | None, typer.Option("--config", help="the run's config (default: config.yaml of the run folder)")
    ] = None,
    max_shard_mb: Annotated[int, typer.Option("--max-shard-mb", help="largest safetensors shard, MiB")] = 5120,
    merge: Annotated[
        bool,
        typer.Option(
            "--merge",
            help="a LoRA run's checkpoint (train.lora): the full model, adapters merged into the base weights "
            "(default: the PEFT adapter folder, adapter_config.json + adapter_model.safetensors)",
        ),
    ] = False,
    base: Annotated[
        str | None,
        typer.Option(
            "--base",
            help="with --merge: the LoRA run's base weights, where its train.init_from has moved (a Hugging Face "
            "folder or a Primus checkpoint)",
        ),
    ] = None,
) -> None:
    """A backend checkpoint -> a Hugging Face folder (config.json, safetensors shards + index, tokenizer); a LoRA
    run's checkpoint -> a PEFT adapter folder, or with --merge the full model. Refuses a checkpoint whose files are
    not what its manifest records, or a folder without manifest (an uncommitted save)."""
    from primus.core.config.errors import ConfigError
    from primus.core.contracts.errors import UserError
    from primus.core.launch.lora_export import export as export_run
    from primus.core.launch.lora_export import offline_overrides, run_base
    from primus.core.launch.resolve import resolve
    from primus.core.run import checkpoints as ckpt
    from primus.core.run.checkpoints import readable

    if not to_hf:
        raise fail(ValueError("--to-hf DIR is required"))
    if base is not None and not merge:
        raise fail(ValueError("--base goes with --merge (the base the adapters merge into)"))
    path = Path(checkpoint)
    if not path.exists():
        raise fail(FileNotFoundError(f"checkpoint {path} does not exist"))
    if not ckpt.read_manifest(path) and not ckpt.complete_checkpoints(path, ckpt.NAMING):
        if merge:
            raise fail(ValueError(f"--merge: {path} is not a Primus checkpoint of a LoRA run (train.lora)"))
        from primus.core.contracts.plugins import get_registry
        from primus.core.launch.native import recognise

        if recognise(path, get_registry()) is not None:  # an engine's own checkpoint: imported on the way
            try:
                import_native_cli(config, overrides or [], path, None, to_hf)
            except (ConfigError, UserError, ValueError) as exc:
                raise fail(exc) from None
            return
    from primus.core.run.init_from import find_run_config

    source = config or find_run_config(path)
    if source is None:
        raise fail(ValueError(f"no config.yaml beside {path} or in its run folder: pass --config"))
    try:
        folder = readable(path)  # the checkpoint itself, or the newest under it, that verifies
        res = resolve(str(source), [*offline_overrides(source), *(overrides or [])], world_size=1)
        cfg = res.config
        run_file = Path(source) if Path(source).is_file() else None
        written = export_run(
            cfg,
            folder,
            to_hf,
            max_shard_bytes=max_shard_mb * 2**20,
            registry=res.registry,
            merge=merge,
            base=base or (run_base(run_file) if run_file else None),
        )
    except (ConfigError, UserError) as exc:
        raise fail(exc) from None
    if folder != path:
        _out.print(f"exporting {folder}, the newest checkpoint under {path} that verifies", highlight=False)
    what = "" if cfg.train.lora is None else (" (LoRA merged into its base)" if merge else " (PEFT LoRA adapter)")
    _out.print(f"exported {folder} ({cfg.backend.name}) -> {written}{what}", highlight=False)


@checkpoint_app.command("verify")
def verify(
    checkpoint: Annotated[str, typer.Argument(help="a checkpoint folder, or a folder of them (each is verified)")],
) -> None:
    """Check a checkpoint's files against its manifest (present, sizes, checksums): OK, or the problems (exit 2)."""
    from primus.core.run import checkpoints as ckpt

    path = Path(checkpoint)
    if not path.is_dir():
        raise fail(FileNotFoundError(f"checkpoint {path} is not a folder"))
    single = ckpt.read_manifest(path) is not None
    folders = [path] if single else [folder for _, folder in ckpt.complete_checkpoints(path, ckpt.NAMING)]
    if not folders:
        raise fail(
            ValueError(
                f"{path} is no committed checkpoint (no {ckpt.MANIFEST}: an uncommitted or partial save) and holds none"
            )
        )
    broken = 0
    for folder in folders:
        man = ckpt.read_manifest(folder) or {}
        problems = ckpt.verify(folder)
        if problems:
            broken += 1
            _out.print(f"BROKEN {folder} (step {man.get('step')}):", highlight=False, soft_wrap=True)
            for problem in problems:
                _out.print(f"  {problem}", highlight=False, soft_wrap=True)
        elif "files" not in man:
            _out.print(
                f"OK {folder} (step {man.get('step')}; written before manifests recorded files: nothing to verify)",
                highlight=False,
                soft_wrap=True,
            )
        else:
            files = man["files"]
            size = sum(r["bytes"] for r in files.values()) / 2**20
            _out.print(
                f"OK {folder} (step {man.get('step')}, {len(files)} files, {size:.1f} MiB)",
                highlight=False,
                soft_wrap=True,
            )
    if broken:
        raise typer.Exit(2)
