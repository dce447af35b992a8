"""``train.init_from``: the one key that starts a run from existing weights, on every engine.

It takes either
- a **Hugging Face folder** (``config.json`` + ``*.safetensors``): the architecture is ``config.json``'s. Its
  model fields form a layer of their own, above the presets and recipes and below the user's own file and the
  command line (``primus config show`` names it ``config.json <folder>``); a model field the user set that
  disagrees with ``config.json`` is refused with both values. So ``primus train tiny-demo
  train.init_from=HF_DIR`` trains the HF model, whatever its shape;
- a **Primus checkpoint** of either engine: a step folder (``manifest.json``) or a checkpoints folder (its newest
  complete checkpoint). Only the model weights are taken; the run's model must have the checkpoint's shape.
  A checkpoint of the other engine is converted once, by rank 0, to a Hugging Face folder under
  ``<output_dir>/init_from`` (``primus checkpoint export`` in a child process), and the run starts from that.
  A LoRA run's checkpoint (``train.lora``: adapters, not the model) of either engine is converted there too, its
  adapters merged into its base (``export --merge``).

The engines load what :func:`source` describes (``kind`` ``hf`` or a checkpoint of their own) into their own
layout: Megatron through its HF importer or dist checkpoint, TorchTitan through its state-dict adapter or DCP.
This module imports neither torch nor an engine.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primus.core.config.errors import ConfigError
from primus.core.contracts.errors import UserError
from primus.core.contracts.protocols import ConfigIssue
from primus.core.run import checkpoints

if TYPE_CHECKING:
    from primus.core.config.loader import Layered
    from primus.core.config.schema import PrimusConfig

log = logging.getLogger("primus.init_from")

KEY = "train.init_from"
ALLOWED = (
    "a Hugging Face folder (config.json + *.safetensors) or a Primus checkpoint (a step folder or a folder of them)"
)


@dataclass(frozen=True)
class Source:
    kind: str  # "hf" | "checkpoint"
    path: Path  # the HF folder, or the checkpoint folder itself
    backend: str | None = None  # the engine that wrote a checkpoint


def find_run_config(checkpoint: Path) -> Path | None:
    """The config.yaml of the run a checkpoint belongs to (beside it, or in the run folder above it)."""
    for folder in (checkpoint, *list(checkpoint.absolute().parents)[:3]):
        if (folder / "config.yaml").is_file():
            return folder / "config.yaml"
    return None


def _checkpoint_backend(folder: Path, manifest: dict[str, Any]) -> str | None:
    if manifest.get("backend"):
        return manifest["backend"]
    run_config = find_run_config(folder)  # checkpoints written before manifests named their backend
    if run_config is None:
        return None
    import yaml

    return (yaml.safe_load(run_config.read_text()) or {}).get("backend", {}).get("name")


def source(value: str | Path) -> Source:
    """What ``train.init_from`` names; a :class:`UserError` naming the key when it is neither kind."""
    from primus.core.hf.safetensors_io import folder_problem

    path = Path(value).expanduser().absolute()
    if not path.exists():
        raise UserError(f"{KEY}: no such file or folder: {path}; allowed: {ALLOWED}")
    if (path / "config.json").is_file():
        if problem := folder_problem(path):
            raise UserError(f"{KEY}: {problem}; allowed: {ALLOWED}")
        return Source("hf", path)
    manifest = checkpoints.read_manifest(path)
    if manifest is None:
        found = checkpoints.latest(path, checkpoints.NAMING)
        if found is None:
            raise UserError(
                f"{KEY}: {path} is neither a Hugging Face folder (no config.json) nor a Primus checkpoint (no "
                f"manifest.json, no complete step folders); allowed: {ALLOWED}"
            )
        path, manifest = found[1], checkpoints.read_manifest(found[1]) or {}
    return Source("checkpoint", path, _checkpoint_backend(path, manifest))


def apply_layers(layers: Layered) -> None:
    """Before validation: with ``train.init_from`` a Hugging Face folder, its ``config.json`` becomes the model's
    layer (see the module docstring). Refuses a model field the user set in their own file or on the command line
    that disagrees with ``config.json``, naming both values, and a folder whose tensors are not the model's.
    ``model.mtp`` is the user's where they set it (refused, naming the key, where the folder lacks its weights),
    else :func:`settle_mtp`'s."""
    from primus.core.hf.config import model_fields_from_hf

    value = layers.data.get("train", {}).get("init_from")
    if not value or not isinstance(value, str):
        return
    try:
        src = source(value)
    except UserError as exc:
        raise ConfigError([ConfigIssue(KEY, str(exc).removeprefix(f"{KEY}: "), value=value)]) from None
    if src.kind != "hf":
        _checkpoint_tokenizer(layers, src)
        return
    hf = json.loads((src.path / "config.json").read_text())
    fields = model_fields_from_hf(hf, name=src.path.name)
    if note := settle_mtp(fields, src.path, layers.sources):
        layers.notes.append(f"{KEY}: {note}")  # `primus train` says it
    label = f"config.json {src.path}"
    model = layers.data.setdefault("model", {})
    clashes = []
    for key, theirs in fields.items():
        where = layers.sources.get(f"model.{key}", "default")
        if user_set(where):
            if key != "name" and model.get(key) != theirs:
                clashes.append(f"model.{key} {model.get(key)!r} vs {theirs!r} (set in {where})")
            continue
        layers.merge({"model": {key: theirs}}, label)
    if (src.path / "tokenizer.json").is_file() and takes_model_tokenizer(layers.sources.get("data.tokenizer")):
        layers.merge({"data": {"tokenizer": str(src.path)}}, label)  # the model's own tokenizer (and chat template)
    if clashes:
        message = f"the model you set disagrees with {src.path / 'config.json'} (yours first): " + "; ".join(clashes)
        raise ConfigError(
            [ConfigIssue(KEY, message, allowed="leave those fields out: the folder's config.json sets them")]
        )
    _check_tensors(src.path, fields, model.get("mtp"), value, users_mtp=sets_mtp(layers.sources))


def user_set(where: str | None) -> bool:
    """Whether a config value's layer (``where``) is the user's own: their file or the command line, not a default,
    preset or plugin."""
    return where not in (None, "default") and not where.startswith(("preset ", "plugin "))


def sets_mtp(sources: dict[str, str]) -> bool:
    """Whether the user set ``model.mtp`` (or a field of it) in their file or on the command line (``sources``: the
    config's layers)."""
    return any(user_set(w) for k, w in sources.items() if k == "model.mtp" or k.startswith("model.mtp."))


def settle_mtp(fields: dict[str, Any], folder: Path, sources: dict[str, str]) -> str | None:
    """Decide ``model.mtp`` for a Hugging Face folder's model ``fields`` (:func:`model_fields_from_hf`, changed in
    place), as ``train.init_from`` and ``primus checkpoint import --from-hf`` both take it: a ``model.mtp`` the user
    set (``sources``: the config's layers; ``null`` included) stands, so ``fields`` lose theirs; else config.json's
    multi-token-prediction depths (DeepSeek-V3's ``num_nextn_predict_layers``) where the folder holds their weights,
    and none where it holds none (``transformers`` writes ``num_nextn_predict_layers: 1`` and never the weights).
    Returns what to say in that last case, else None."""
    from primus.core.hf.safetensors_io import HFReader

    if sets_mtp(sources):
        fields.pop("mtp", None)
        return None
    depths = (fields.get("mtp") or {}).get("layers", 0)
    if depths and f"model.layers.{fields['num_layers']}.eh_proj.weight" not in HFReader(folder):
        fields["mtp"] = None
        return (
            f"{folder / 'config.json'} names {depths} multi-token-prediction depth(s) (num_nextn_predict_layers) "
            "without their weights, as transformers writes it: no model.mtp"
        )
    return None


def takes_model_tokenizer(where: str | None) -> bool:
    """Whether a run takes the tokenizer of the weights it starts from (a HF folder's, an imported checkpoint's):
    unless the user set ``data.tokenizer`` (``where``: its layer) in their file or on the command line."""
    return where in (None, "default") or where.startswith("preset ")


def _check_tensors(folder: Path, fields: dict[str, Any], mtp: Any, value: str, users_mtp: bool) -> None:
    """Refuse, before the run, a folder whose tensors are not the model's (``fields`` with the run's ``mtp``):
    missing, or some Primus would drop. Where only the ``model.mtp`` the user set (``users_mtp``) is what the
    folder cannot supply, the refusal names that key."""
    from primus.core.config.schema import ModelConfig
    from primus.core.hf.contract import tensor_problem
    from primus.core.hf.safetensors_io import HFReader

    try:
        reader = HFReader(folder)
        problem = tensor_problem(ModelConfig.model_validate({**fields, "mtp": mtp}), reader)
        only_mtp = bool(problem and users_mtp and mtp is not None) and not tensor_problem(
            ModelConfig.model_validate({**fields, "mtp": None}), reader
        )
    except (UserError, ValueError):  # an architecture Primus cannot build, an unreadable file: named later
        return
    if only_mtp:
        raise ConfigError([ConfigIssue("model.mtp", f"{folder}: {problem}", value=mtp)])
    if problem:
        raise ConfigError([ConfigIssue(KEY, f"{folder}: {problem}", value=value)])


def _checkpoint_tokenizer(layers: Layered, src: Source) -> None:
    """A checkpoint's tokenizer (``data.tokenizer`` of its run's, or its import's, config.yaml) where it names files
    still there, unless the user set one: the tokenizer its embedding was trained with."""
    import yaml

    run_config = find_run_config(src.path)
    if run_config is None or not takes_model_tokenizer(layers.sources.get("data.tokenizer")):
        return
    try:
        spec = ((yaml.safe_load(run_config.read_text()) or {}).get("data") or {}).get("tokenizer")
    except (OSError, yaml.YAMLError):
        return
    if isinstance(spec, str) and spec != "bundled" and Path(spec).expanduser().exists():
        layers.merge({"data": {"tokenizer": spec}}, f"config.yaml {run_config}")


def trains_lora(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` is a LoRA run's (its run's config.yaml sets ``train.lora``): it holds adapters, not
    the weights of the model."""
    import yaml

    config = find_run_config(checkpoint)
    if config is None:
        return False
    data = yaml.safe_load(config.read_text()) or {}
    return isinstance(data, dict) and bool((data.get("train") or {}).get("lora"))


def prepare(cfg: PrimusConfig, rank: int, output_dir: Path, timeout_s: float) -> PrimusConfig:
    """The run's config with ``train.init_from`` something its engine loads: a checkpoint of another engine is
    converted to a Hugging Face folder once (rank 0; the other ranks wait for it on the shared file system), and so
    is a LoRA run's checkpoint of any engine, its adapters merged into its base (``primus checkpoint export
    --merge``): the weights of the model it trained."""
    value = cfg.train.init_from
    if not value:
        return cfg
    src = source(value)
    lora = src.kind == "checkpoint" and trains_lora(src.path)
    if src.kind == "hf" or (src.backend == cfg.backend.name and not lora):
        return cfg
    target = output_dir / "init_from" / f"{src.backend}-{src.path.name}"
    done = target / ".converted"
    if rank == 0 and not done.is_file():
        what = "a LoRA run's checkpoint: merging its adapters into its base as" if lora else "converting it to"
        log.info("%s is a %s checkpoint, %s a Hugging Face folder %s", src.path, src.backend, what, target)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PRIMUS_LAUNCHED")}
        cmd = [
            sys.executable,
            "-m",
            "primus.core.cli.app",
            "checkpoint",
            "export",
            str(src.path),
            "--to-hf",
            str(target),
            *(["--merge"] if lora else []),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise UserError(f"{KEY} {src.path}: converting the {src.backend} checkpoint failed:\n{proc.stderr[-3000:]}")
        done.write_text(str(src.path))
    deadline = time.monotonic() + timeout_s
    while not done.is_file():  # another rank converts
        if time.monotonic() > deadline:
            raise UserError(f"{KEY}: rank 0 did not convert {src.path} within {timeout_s:.0f} s")
        time.sleep(1.0)
    train = cfg.train.model_copy(update={"init_from": str(target)})
    return cfg.model_copy(update={"train": train})
