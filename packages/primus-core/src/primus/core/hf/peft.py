"""LoRA adapters in PEFT's format (``train.lora``): the folder ``peft.PeftModel.from_pretrained`` loads, written and
read without importing PEFT (torch, safetensors and json only).

A PEFT LoRA folder holds ``adapter_config.json`` (a ``LoraConfig``: ``r``, ``lora_alpha``, ``target_modules`` ...)
and ``adapter_model.safetensors``, whose tensors are the adapters' HF names (:func:`primus.core.hf.lora.
tensor_names`: ``model.layers.0.self_attn.q_proj.lora_A.weight``) behind PEFT's ``base_model.model.`` prefix.

- :func:`write_adapter`: the trained adapters -> such a folder (``primus checkpoint export`` of a LoRA run).
- :func:`read_adapter`: such a folder -> the adapters of a run (``train.lora.init_from``), refused with the key,
  the folder's value and the config's where the folder is not the adapters ``train.lora`` describes.
- :func:`merge`: base weights + adapters -> ``W + (alpha / rank) · B A`` (``primus checkpoint export --merge``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primus.core.contracts.errors import UserError

if TYPE_CHECKING:
    import torch

    from primus.core.config.errors import ConfigIssue
    from primus.core.config.schema import LoRAConfig, PrimusConfig

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's names: the PeftModel's base_model (LoraModel) wraps the HF model as .model
PEFT_FORMAT = "0.22.0"  # the PEFT version whose LoraConfig.save_pretrained output write_adapter reproduces


class AdapterError(UserError):
    """A PEFT adapter folder that is not the adapters ``train.lora`` describes (or not a PEFT LoRA folder)."""


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def adapter_config(lora: LoRAConfig, base: str | None, targets: list[str] | None = None) -> dict[str, Any]:
    """``adapter_config.json`` as PEFT 0.22's ``PeftModel.save_pretrained`` writes it for the ``LoraConfig`` of
    ``lora`` (task CAUSAL_LM, no bias, PEFT's default initialisation, plain ``alpha / r`` scaling); ``base``: the
    base model's folder or Hub name (``base_model_name_or_path``), or None; ``targets``: the ``target_modules`` that
    adapt the model (:func:`primus.core.hf.lora.targets`; default ``lora``'s). (PEFT's keys for other frameworks' layers
    and for options Primus does not use are left out: PEFT reads their defaults.)"""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base,
        "bias": "none",
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": _number(lora.alpha),
        "lora_bias": False,
        "lora_dropout": float(lora.dropout),
        "modules_to_save": None,
        "peft_type": "LORA",
        "peft_version": PEFT_FORMAT,
        "r": lora.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": list(targets if targets is not None else lora.target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def _expected(cfg: PrimusConfig) -> dict[str, tuple[int, int]]:
    """HF name -> shape of every adapter tensor of ``cfg`` (``train.lora`` set)."""
    from primus.core.hf.lora import A, B, adapters

    lora = _lora(cfg)
    return {a.name(w): a.shape(w, lora.rank) for a in adapters(cfg.model, lora) for w in (A, B)}


def _lora(cfg: PrimusConfig) -> LoRAConfig:
    if cfg.train.lora is None:
        raise UserError("train.lora is not set: the run trains no adapters")
    return cfg.train.lora


def write_adapter(
    out: str | Path, tensors: Mapping[str, torch.Tensor], cfg: PrimusConfig, base: str | None = None
) -> Path:
    """Write the adapters ``tensors`` (HF name -> tensor, exactly :func:`primus.core.hf.lora.tensor_names` of
    ``cfg``) as the PEFT folder ``out`` (``adapter_config.json`` + ``adapter_model.safetensors``, fp32); ``base``:
    the base model it adapts (``base_model_name_or_path``). Returns ``out``."""
    from safetensors.torch import save_file

    expected = _expected(cfg)
    if set(tensors) != set(expected):
        odd = sorted(set(tensors) ^ set(expected))
        raise RuntimeError(f"the adapters to write differ from train.lora's in {len(odd)} name(s), e.g. {odd[:4]}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise RuntimeError(f"adapter {name} has shape {tuple(tensors[name].shape)}; train.lora's is {shape}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {PREFIX + n: tensors[n].detach().to("cpu").float().contiguous() for n in expected}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    from primus.core.hf.lora import targets

    text = json.dumps(adapter_config(_lora(cfg), base, targets(cfg.model, _lora(cfg))), indent=2, sort_keys=True)
    (out / CONFIG).write_text(text + "\n")
    return out


def is_adapter_folder(folder: str | Path) -> bool:
    return (Path(folder) / CONFIG).is_file()


def adapter_settings(folder: str | Path) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``folder``; an :class:`AdapterError` when it has none or it is not JSON."""
    path = Path(folder).expanduser() / CONFIG
    if not path.is_file():
        what = "no such folder" if not path.parent.is_dir() else f"it has no {CONFIG}"
        raise AdapterError(f"{path.parent} is not a PEFT adapter folder: {what}")
    try:
        settings = json.loads(path.read_text())
    except ValueError as exc:
        raise AdapterError(f"{path}: not JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise AdapterError(f"{path}: not a JSON object")
    return settings


def settings_problem(settings: Mapping[str, Any], cfg: PrimusConfig) -> str | None:
    """Why a PEFT ``adapter_config.json`` (``settings``) is not the adapters ``lora`` describes: the key, the
    folder's value and the config's; or None. Dropout is not compared (it acts in training only); ``target_modules``
    may be the config's or those that adapt its model (:func:`primus.core.hf.lora.targets`, what Primus writes)."""
    from primus.core.hf.lora import targets as adapted

    lora = _lora(cfg)
    peft_type = settings.get("peft_type")
    if peft_type != "LORA":
        return f"peft_type is {peft_type!r} in {CONFIG}; Primus reads LoRA adapters (peft_type 'LORA')"
    r, alpha = settings.get("r"), settings.get("lora_alpha")
    if r != lora.rank:
        return f"r is {r!r} in {CONFIG}, train.lora.rank is {lora.rank}"
    if not isinstance(alpha, int | float) or float(alpha) != float(lora.alpha):
        return f"lora_alpha is {alpha!r} in {CONFIG}, train.lora.alpha is {_number(lora.alpha)}"
    targets = settings.get("target_modules")
    allowed = (set(lora.target_modules), set(adapted(cfg.model, lora)))
    if not isinstance(targets, list) or set(targets) not in allowed:
        return f"target_modules is {targets!r} in {CONFIG}, train.lora.target_modules is {list(lora.target_modules)}"
    # what changes the adapters' meaning beyond W + (alpha / r) B A on every targeted projection: refused by key
    plain = {
        "use_rslora": False,  # scaling alpha / sqrt(r)
        "use_dora": False,  # a magnitude vector besides A and B
        "bias": "none",
        "fan_in_fan_out": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,  # whole modules trained beside the adapters
        "layers_to_transform": None,
        "layer_replication": None,
        "lora_bias": False,
        "trainable_token_indices": None,
        "target_parameters": None,
        "use_qalora": False,
        "use_bdlora": None,
        "alora_invocation_tokens": None,
    }
    for key, default in plain.items():
        value = settings.get(key, default)
        if value != default and not (default is None and value in ([], {})):
            return f"{key} is {value!r} in {CONFIG}; Primus reads adapters with {key}={json.dumps(default)} only"
    return None


def init_from_issues(cfg: PrimusConfig) -> list[ConfigIssue]:
    """``train.lora.init_from``: a PEFT folder of the adapters ``train.lora`` describes (its ``adapter_config.json``: r,
    lora_alpha, target_modules, ...; the tensors are checked when read). Called when a config is resolved, before
    anything is written; the config room's own rules (:func:`primus.core.config.validate.lora_issues`) read no
    files."""
    from primus.core.config.errors import ConfigIssue

    lora = cfg.train.lora
    if lora is None or not lora.init_from:
        return []
    try:
        problem = settings_problem(adapter_settings(lora.init_from), cfg)
    except AdapterError as exc:
        problem = str(exc)
    if not problem:
        return []
    allowed = "a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) of train.lora's adapters"
    return [ConfigIssue("train.lora.init_from", problem, value=lora.init_from, allowed=allowed)]


def read_adapter(folder: str | Path, cfg: PrimusConfig) -> dict[str, torch.Tensor]:
    """The adapters of the PEFT folder ``folder`` (HF name -> fp32 CPU tensor, exactly :func:`primus.core.hf.lora.
    tensor_names` of ``cfg``), for a run of ``cfg`` to start from (``train.lora.init_from``). Refuses, naming the
    key, the folder's value and the config's, a folder whose ``r``, ``lora_alpha`` or ``target_modules`` are not
    ``train.lora``'s, whose tensors are not the model's adapters (names, shapes), or that is not a plain LoRA."""
    from safetensors import SafetensorError, safe_open

    lora = _lora(cfg)
    folder = Path(folder).expanduser()
    where = f"train.lora.init_from {folder}"
    if problem := settings_problem(adapter_settings(folder), cfg):
        raise AdapterError(f"{where}: {problem}")
    weights = folder / WEIGHTS
    if not weights.is_file():
        other = (
            " (PEFT's older adapter_model.bin is not read: save with safetensors)" if any(folder.glob("*.bin")) else ""
        )
        raise AdapterError(f"{where}: the folder has no {WEIGHTS}{other}")
    expected = _expected(cfg)
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            names = {n.removeprefix(PREFIX): n for n in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
            if missing := sorted(set(expected) - set(names)):
                raise AdapterError(
                    f"{where}: {WEIGHTS} lacks {len(missing)} adapter tensor(s) of the model and train.lora, e.g. "
                    f"{missing[:3]} (another model, or other target_modules / layers)"
                )
            if extra := sorted(set(names) - set(expected)):
                raise AdapterError(
                    f"{where}: {WEIGHTS} holds {len(extra)} tensor(s) that are none of the model's adapters, e.g. "
                    f"{extra[:3]}"
                )
            for name, shape in expected.items():
                t = f.get_tensor(names[name])
                if tuple(t.shape) != shape:
                    raise AdapterError(
                        f"{where}: {name} has shape {list(t.shape)} in {WEIGHTS}, the model with train.lora.rank "
                        f"{lora.rank} has {list(shape)} (another model?)"
                    )
                tensors[name] = t.float().contiguous()
    except SafetensorError as exc:
        raise AdapterError(f"{where}: {WEIGHTS} is not a safetensors file ({exc})") from None
    return tensors


def merge(
    base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], cfg: PrimusConfig
) -> dict[str, torch.Tensor]:
    """The HF weights ``base`` with every adapted projection ``W`` replaced by ``W + (alpha / rank) · B A`` (in
    ``W``'s dtype, computed in fp32: PEFT's ``merge_and_unload``); the other tensors as they are."""
    from primus.core.hf.lora import A, B, merged
    from primus.core.hf.lora import adapters as adapted

    lora = _lora(cfg)
    out = dict(base)
    for a in adapted(cfg.model, lora):
        weight = a.module + ".weight"
        out[weight] = merged(base[weight], adapters[a.name(A)], adapters[a.name(B)], lora.scaling)
    return out
