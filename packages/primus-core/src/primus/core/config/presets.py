"""The preset catalog: YAML files from every plugin's preset folders.

A preset's name is its file name without ``.yaml``; ``models/`` holds architectures, ``recipes/``
model + train + parallel + kernels layered with ``extends:``. Names are unique across kinds; when
two plugins ship the same name the rule of :mod:`primus.core.contracts.plugins` decides, and it is logged.

Recipe names read ``<model>[-<context>]-<backend>-<layout>[-<device>-<nodes>x<gpus>]``: a cluster-tuned recipe
names its cluster, a seed recipe (core's) only its layout (recompute and the rest are in its description). A plugin
that renames a preset lists the old name in ``renamed.yaml`` at its folder's root (``{old: new}``): the old name
still resolves, with a warning, and is not listed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from primus.core.config.loader import load_layers
from primus.core.config.schema import ModelConfig
from primus.core.contracts.plugins import Registry

log = logging.getLogger("primus.presets")
RENAMED = "renamed.yaml"
_warned: set[str] = set()


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
            if path == folder / RENAMED:
                continue
            kind = "model" if "models" in path.relative_to(folder).parts else "recipe"
            name = path.stem
            if name in found:
                log.info("preset %s from %s is shadowed by %s", name, dist, found[name].dist)
                continue
            found[name] = Preset(name, kind, path, dist)
    return found


def renamed(registry: Registry) -> dict[str, str]:
    """Old preset name -> new, from every plugin's ``renamed.yaml``."""
    import yaml

    out: dict[str, str] = {}
    for _dist, folder in registry.preset_dirs:
        if (folder / RENAMED).is_file():
            out |= yaml.safe_load((folder / RENAMED).read_text()) or {}
    return out


def find(name: str, registry: Registry) -> Preset | None:
    """The preset called ``name``, or the one a plugin renamed it to (with a warning naming the new name)."""
    name = name.removesuffix(".yaml")
    cat = catalog(registry)
    if name in cat:
        return cat[name]
    new = renamed(registry).get(name)
    if new is not None and new in cat:
        if name not in _warned:  # once a process: a config's extends chain resolves names again and again
            _warned.add(name)
            log.warning("preset %s is now called %s: the old name will be removed", name, new)
        return cat[new]
    return None


def resolver(registry: Registry):
    def resolve(name: str) -> Path | None:
        preset = find(name, registry)
        return preset.path if preset else None

    return resolve


def model_config(name: str, registry: Registry) -> ModelConfig:
    """The model section of preset ``name`` (its ``extends`` chain layered), validated."""
    return ModelConfig.model_validate(load_layers(name, resolve_preset=resolver(registry)).data["model"])
