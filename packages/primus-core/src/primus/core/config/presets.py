"""The preset catalog: YAML files from every plugin's preset folders.

A preset's name is its file name without ``.yaml``; ``models/`` holds architectures, ``recipes/``
model + train + parallel + kernels layered with ``extends:``. Names are unique across kinds; when
two plugins ship the same name the rule of :mod:`primus.core.contracts.plugins` decides, and it is logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from primus.core.contracts.plugins import Registry

if TYPE_CHECKING:
    from primus.core.config.schema import ModelConfig

log = logging.getLogger("primus.presets")


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str  # "model" | "recipe"
    path: Path
    dist: str


def catalog(registry: Registry) -> dict[str, Preset]:
    found: dict[str, Preset] = {}
    for dist, folder in registry.preset_dirs:
        for path in sorted(folder.rglob("*.yaml")):
            kind = "model" if "models" in path.relative_to(folder).parts else "recipe"
            name = path.stem
            if name in found:
                log.info("preset %s from %s is shadowed by %s", name, dist, found[name].dist)
                continue
            found[name] = Preset(name, kind, path, dist)
    return found


def resolver(registry: Registry):
    def resolve(name: str) -> Path | None:
        preset = catalog(registry).get(name.removesuffix(".yaml"))
        return preset.path if preset else None

    return resolve


def model_config(name: str, registry: Registry) -> ModelConfig:
    """The model section of preset ``name`` (its ``extends`` chain layered), validated."""
    from primus.core.config.loader import load_layers
    from primus.core.config.schema import ModelConfig

    return ModelConfig.model_validate(load_layers(name, resolve_preset=resolver(registry)).data["model"])
