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


def _say(text: str) -> None:
    _out.print(text, highlight=False)


def fail(exc: Exception) -> typer.Exit:
    _err.print(f"error: {exc}", style="red", highlight=False, markup=False, soft_wrap=True)
    return typer.Exit(2)


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
    from primus.core.launch.native import import_native_run
    from primus.core.launch.resolve import config_with_hf_model
    from primus.core.run.rundir import output_dir

    if bool(from_hf) == bool(from_):
        raise fail(
            ValueError("give one of --from-hf DIR (a Hugging Face folder) and --from PATH (an engine's own checkpoint)")
        )
    if from_:
        try:
            import_native_run(config, overrides or [], Path(from_), out, to_hf, weights_only=weights_only, say=_say)
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
    from primus.core.contracts.errors import UserError
    from primus.core.launch.export import export_command

    try:
        export_command(checkpoint, overrides or [], to_hf, config, max_shard_mb, merge, base, say=_say)
    except (UserError, ValueError) as exc:
        raise fail(exc) from None


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
