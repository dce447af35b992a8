"""``primus checkpoint export`` (:func:`export_command`): a run's checkpoint -> a Hugging Face folder. A LoRA run's
checkpoint (``train.lora``) holds the trained adapters, not the frozen base, so its export is either

- the **PEFT adapter folder** (``adapter_config.json`` + ``adapter_model.safetensors``, :mod:`primus.core.hf.peft`)
  that ``peft.PeftModel.from_pretrained`` loads on the base model, or
- with ``--merge``, the **full model**: the base with each adapted projection ``W + (alpha / rank) · B A``, the HF
  folder ``from_pretrained`` loads.

The engine gives the adapters alone (its :class:`~primus.core.hf.contract.HFInterop` object's ``export_adapters``,
:class:`~primus.core.hf.contract.HFAdapterExport`); the base and the merge are core's: the run's ``train.init_from``
(a HF folder, read here; a Primus checkpoint, its engine's export, itself merged where it is a LoRA run's), or
without one the canonical initial weights of ``train.seed`` (:mod:`primus.core.run.initial_weights`). The run's saved
``config.yaml`` names that base (the resolved config of an export has ``train.init_from`` null:
:data:`~primus.core.hf.contract.OFFLINE_OVERRIDES`, so :func:`run_base` reads it from the file).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primus.core.contracts.errors import UserError
from primus.core.hf.contract import (
    EMBED,
    OFFLINE_OVERRIDES,
    check_folder,
    export_checkpoint,
    export_tokenizer,
    full_weights,
    hf_names,
    interop,
)

if TYPE_CHECKING:
    from primus.core.config.schema import PrimusConfig
    from primus.core.contracts.plugins import Registry


def export(
    cfg: PrimusConfig,
    folder: str | Path,
    out: str | Path,
    *,
    merge: bool = False,
    base: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    registry: Registry | None = None,
) -> Path:
    """``primus checkpoint export``: the checkpoint ``folder`` of a run of ``cfg`` -> ``out``. A LoRA run's: the PEFT
    adapter folder (:func:`export_adapter_folder`), or with ``merge`` the full model (:func:`lora_weights`);
    ``base``: the run's base weights, its ``train.init_from`` (None: the canonical initial weights of
    ``train.seed``). Another run's: its weights (:func:`~primus.core.hf.contract.export_checkpoint`); ``merge``
    refused."""
    from primus.core.contracts.plugins import get_registry
    from primus.core.hf.config import hf_config
    from primus.core.hf.safetensors_io import write_hf

    folder, registry = Path(folder), registry or get_registry()
    if cfg.train.lora is None:
        if merge:
            raise UserError(
                f"--merge merges LoRA adapters into their base, and {folder} is not a LoRA run's checkpoint (its "
                "config has no train.lora): export it without --merge, which writes its full weights"
            )
        return export_checkpoint(cfg, folder, out, max_shard_bytes=max_shard_bytes, registry=registry)
    if not merge:
        return export_adapter_folder(cfg, folder, out, base=base, registry=registry)
    ordered = lora_weights(cfg, folder, base, registry)
    dtype = str(ordered[EMBED].dtype).removeprefix("torch.")
    tokenizer = export_tokenizer(cfg, folder)
    return write_hf(out, ordered, hf_config(cfg.model, dtype), max_shard_bytes=max_shard_bytes, tokenizer=tokenizer)


def adapters_of(cfg: PrimusConfig, folder: Path, registry: Registry) -> dict[str, Any]:
    """The trained adapters of the LoRA run's checkpoint ``folder`` (:meth:`HFAdapterExport.export_adapters`)."""
    from primus.core.hf.lora import tensor_names

    assert cfg.train.lora is not None
    hf = interop(cfg, registry)
    export = getattr(hf, "export_adapters", None)
    if export is None:
        raise UserError(f"backend {cfg.backend.name!r} does not export LoRA adapters (train.lora) yet")
    tensors = export(cfg, folder)
    expected = tensor_names(cfg.model, cfg.train.lora)
    if sorted(tensors) != sorted(expected):
        raise RuntimeError(
            f"backend {cfg.backend.name} exported adapters {sorted(set(tensors) ^ set(expected))[:6]} outside "
            "train.lora's names"
        )
    return {n: tensors[n] for n in expected}


def base_weights(cfg: PrimusConfig, base: str | None, registry: Registry) -> dict[str, Any]:
    """The frozen base weights of a LoRA run of ``cfg`` (HF-named, :func:`hf_names` order), at the run's compute
    dtype (``train.precision``: how the engine held them): ``base`` is the run's ``train.init_from``, a HF folder
    (read here) or a Primus checkpoint (its engine's export; a LoRA checkpoint's merged weights), or None: the
    canonical initial weights of ``train.seed`` (:mod:`primus.core.run.initial_weights`)."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.train.precision]
    names = hf_names(cfg.model)
    if base is None:
        from primus.core.run.initial_weights import tensor

        return {n: tensor(n, cfg.model, cfg.train.seed).to(dtype) for n in names}
    from primus.core.hf.safetensors_io import HFReader
    from primus.core.run.init_from import source

    where = f"the run's base (train.init_from) {base}"
    try:
        src = source(base)
    except UserError as exc:
        raise UserError(f"{where}: {str(exc).removeprefix('train.init_from: ')}; pass --base DIR") from None
    if src.kind == "hf":
        reader = HFReader(src.path)
        check_folder(cfg.model, reader, where)
        return {n: reader.get(n).to(dtype) for n in names}
    from primus.core.launch.resolve import resolve
    from primus.core.run.checkpoints import readable
    from primus.core.run.init_from import find_run_config

    config = find_run_config(src.path)
    if config is None:
        raise UserError(f"{where}: no config.yaml beside the checkpoint or in its run folder")
    res = resolve(str(config), list(offline_overrides(config)), world_size=1, registry=registry)
    folder = readable(src.path)
    if res.config.train.lora is not None:  # a LoRA run's checkpoint: its base with its adapters merged
        tensors = lora_weights(res.config, folder, run_base(config), registry)
    else:
        tensors = full_weights(res.config, folder, registry)
    return {n: tensors[n].to(dtype) for n in names}


def lora_weights(cfg: PrimusConfig, folder: Path, base: str | None, registry: Registry) -> dict[str, Any]:
    """The full weights of the LoRA run's checkpoint ``folder``: its base (:func:`base_weights`) with each adapted
    projection ``W + (alpha / rank) · B A`` (in ``W``'s dtype, computed in fp32)."""
    from primus.core.hf.peft import merge

    return merge(base_weights(cfg, base, registry), adapters_of(cfg, folder, registry), cfg)


def export_adapter_folder(
    cfg: PrimusConfig, folder: Path, out: str | Path, *, base: str | None, registry: Registry
) -> Path:
    """The LoRA run's checkpoint ``folder`` -> the PEFT adapter folder ``out`` (``adapter_config.json`` +
    ``adapter_model.safetensors``, and the run's tokenizer) that ``peft.PeftModel.from_pretrained`` loads on the
    base model; ``base``: the run's ``train.init_from``, written as ``base_model_name_or_path``."""
    from primus.core.hf.peft import write_adapter
    from primus.core.hf.safetensors_io import copy_tokenizer

    tensors = adapters_of(cfg, folder, registry)
    named = str(Path(base).expanduser().absolute()) if base and Path(base).expanduser().exists() else base
    out = write_adapter(out, tensors, cfg, base=named)
    if (tokenizer := export_tokenizer(cfg, folder)) is not None:
        copy_tokenizer(tokenizer, out)
    return out


def run_base(config: str | Path) -> str | None:
    """The base weights a run's ``config.yaml`` names: its ``train.init_from`` as written (the resolved config has
    it null: :data:`OFFLINE_OVERRIDES`)."""
    import yaml

    data = yaml.safe_load(Path(config).read_text()) or {}
    return ((data.get("train") or {}).get("init_from")) or None


def offline_overrides(config: str | Path | None) -> tuple[str, ...]:
    """:data:`OFFLINE_OVERRIDES` for reading the checkpoint of the run ``config`` (a config.yaml): and, where it
    trains LoRA adapters, not where they started from (``train.lora.init_from``, which may be gone too)."""
    import yaml

    if config is None or not Path(config).is_file():
        return OFFLINE_OVERRIDES
    data = yaml.safe_load(Path(config).read_text()) or {}
    lora = (data.get("train") or {}).get("lora") if isinstance(data, dict) else None
    if isinstance(lora, dict) and lora.get("init_from"):
        return (*OFFLINE_OVERRIDES, "train.lora.init_from=null")
    return OFFLINE_OVERRIDES


def export_command(
    checkpoint: str,
    overrides: list[str],
    to_hf: str,
    config: str | None,
    max_shard_mb: int,
    merge: bool,
    base: str | None,
    say: Callable[[str], None],
) -> None:
    """``primus checkpoint export``: a backend checkpoint (or the newest that verifies in a folder of them) -> a
    Hugging Face folder; a LoRA run's -> a PEFT adapter folder, or with ``merge`` the full model; an engine's own
    checkpoint is imported on the way (:func:`primus.core.launch.native.import_native_run`). ``say`` prints a line.
    Refusals raise :class:`UserError`: a checkpoint whose files are not what its manifest records, or a folder without
    manifest (an uncommitted save)."""
    from primus.core.launch.resolve import resolve
    from primus.core.run import checkpoints as ckpt
    from primus.core.run.checkpoints import readable
    from primus.core.run.init_from import find_run_config

    if not to_hf:
        raise UserError("--to-hf DIR is required")
    if base is not None and not merge:
        raise UserError("--base goes with --merge (the base the adapters merge into)")
    path = Path(checkpoint)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    if not ckpt.read_manifest(path) and not ckpt.complete_checkpoints(path, ckpt.NAMING):
        if merge:
            raise UserError(f"--merge: {path} is not a Primus checkpoint of a LoRA run (train.lora)")
        from primus.core.contracts.plugins import get_registry
        from primus.core.launch.native import import_native_run, recognise

        if recognise(path, get_registry()) is not None:  # an engine's own checkpoint: imported on the way
            import_native_run(config, overrides, path, None, to_hf, say=say)
            return
    source = config or find_run_config(path)
    if source is None:
        raise UserError(f"no config.yaml beside {path} or in its run folder: pass --config")
    folder = readable(path)  # the checkpoint itself, or the newest under it, that verifies
    res = resolve(str(source), [*offline_overrides(source), *overrides], world_size=1)
    cfg = res.config
    run_file = Path(source) if Path(source).is_file() else None
    written = export(
        cfg,
        folder,
        to_hf,
        max_shard_bytes=max_shard_mb * 2**20,
        registry=res.registry,
        merge=merge,
        base=base or (run_base(run_file) if run_file else None),
    )
    if folder != path:
        say(f"exporting {folder}, the newest checkpoint under {path} that verifies")
    what = "" if cfg.train.lora is None else (" (LoRA merged into its base)" if merge else " (PEFT LoRA adapter)")
    say(f"exported {folder} ({cfg.backend.name}) -> {written}{what}")
