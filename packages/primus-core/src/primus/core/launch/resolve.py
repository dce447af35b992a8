"""A config resolved for a run: layered (presets, recipes, files, plugins' ``primus_configure``, overrides), validated,
its folders' contents read (``train.init_from``'s config.json, ``train.lora.init_from``'s adapter_config.json) and
its parallel layout filled (a named strategy, or the planner's pick for ``auto``): :func:`resolve`.

Every command that takes a config resolves it here, before anything is written.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primus.core.config.errors import ConfigError
from primus.core.config.loader import Layered, load_layers, nest
from primus.core.config.presets import resolver
from primus.core.config.schema import PrimusConfig
from primus.core.config.validate import resolve_parallel, validate_config
from primus.core.contracts.plugins import Registry, get_registry
from primus.core.run.init_from import apply_layers

log = logging.getLogger("primus.hf")


@dataclass
class Resolved:
    config: PrimusConfig
    layers: Layered
    registry: Registry
    world_size: int


def configure_changes(registry: Registry):
    """Run every plugin's ``primus_configure`` and label its change with the plugin's distribution. Where two
    plugins set one key, the one pluggy calls first wins (``tryfirst``, else the one registered last)."""

    def run(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        changes = []
        for plugin_name, call in registry.pm.each_impl("primus_configure"):
            change = Layered()
            for result in call(config=data):
                for key, value in (result or {}).items():
                    change.merge(nest(key, value), "")
            if change.data:
                changes.append((f"plugin {registry.pm.dist_of(plugin_name)}", change.data))
        return changes[::-1]  # merged in list order: the first called is merged last, so it wins

    return run


def resolve(
    config: str | None,
    overrides: Sequence[str] = (),
    world_size: int | None = None,
    registry: Registry | None = None,
    check_plugins: bool = True,
) -> Resolved:
    """Load, layer and validate; ``check_plugins=False`` skips the checks that need installed plugins
    (backend and kernel names), so ``primus config show`` works with primus-core alone."""
    registry = registry or get_registry()
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    layers = load_layers(config, overrides, resolver(registry), configure=configure_changes(registry))
    apply_layers(layers)  # train.init_from: a Hugging Face folder's config.json is the model's layer
    cfg = validate_config(layers.data, world_size=world_size, registry=registry if check_plugins else None)
    if cfg.train.lora is not None and cfg.train.lora.init_from:  # the config's rules pass; now the folder it names
        from primus.core.hf.peft import init_from_issues

        if issues := init_from_issues(cfg):
            raise ConfigError(issues)
    strategy = cfg.parallel.strategy
    if strategy not in ("auto", "manual"):
        from primus.core.contracts.protocols import load_ref

        # a named strategy fills the parallel section; sizes the user set explicitly stay as given
        explicit = {
            k.split(".")[1] for k in layers.sources if k.startswith("parallel.") and layers.sources[k] != "default"
        }
        filled = load_ref(registry.strategies[strategy].fill)(cfg.parallel.model_dump(), world_size, cfg)
        kept = {k: v for k, v in filled.items() if k not in explicit or k == "strategy"}
        data = cfg.model_dump()
        data["parallel"] = {**data["parallel"], **kept}
        cfg = validate_config(data, world_size=world_size, registry=registry if check_plugins else None)
    if cfg.parallel.strategy == "auto":
        from primus.core.planner.auto import choose

        explicit = {k.split(".")[1] for k in layers.sources if k.startswith("parallel.")}
        cfg = validate_config(choose(cfg, explicit, world_size, registry=registry).model_dump(), world_size=world_size)
    return Resolved(resolve_parallel(cfg, world_size), layers, registry, world_size)


def searched_micro_batches(res: Resolved) -> int | tuple[int, ...]:
    """The micro-batch sizes the planner tries for a run: the one given on the command line, else the config's, then
    the others of :data:`~primus.core.planner.search.MICRO_BATCHES` (another is recommended only where it is
    faster)."""
    from primus.core.planner.search import MICRO_BATCHES

    mbs = res.config.train.micro_batch_size
    if res.layers.sources.get("train.micro_batch_size") == "command line":
        return mbs
    return (mbs, *(m for m in MICRO_BATCHES if m != mbs))


def config_with_hf_model(config: str, overrides: list[str], hf_dir: str, check_plugins: bool = True):
    """The resolved config of ``config`` + ``overrides`` whose model is the HF folder's architecture, and whose
    tokenizer is the folder's (unless the user set ``data.tokenizer``, as with ``train.init_from``).
    ``check_plugins=False``: without the checks that need the installed backends (as ``resolve`` has it)."""
    import json

    from primus.core.hf.config import model_fields_from_hf
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
