"""Read YAML layers into one nested dict, remembering which layer set each value.

Layering, lowest first: schema defaults → ``extends:`` parents (depth first, in list order) → the
file itself → plugin ``primus_configure`` changes (plugins see the overrides too) → ``key.sub=value``
overrides, which always win.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from primus.core.config.errors import ConfigError
from primus.core.config.fields import coerce
from primus.core.protocols import ConfigIssue


class _Loader(yaml.SafeLoader):
    """SafeLoader (no object construction) that reads ``3e-4`` as a float, as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_scalar(text: str) -> Any:
    """Parse one YAML scalar (command-line values, ``${VAR}`` values)."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError:
        return text


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except FileNotFoundError:
        raise ConfigError([ConfigIssue(str(path), "file not found")]) from None
    except UnicodeDecodeError as exc:
        where = f"byte {exc.object[exc.start : exc.start + 1].hex()} at offset {exc.start}"
        raise ConfigError(
            [ConfigIssue(str(path), f"not UTF-8 text ({where})", allowed="a YAML file saved as UTF-8")]
        ) from None
    except OSError as exc:  # unreadable (permissions), a folder, ...
        raise ConfigError([ConfigIssue(str(path), f"cannot read it: {exc.strerror or exc}")]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigIssue(str(path), f"not valid YAML: {exc}")]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue(str(path), f"top level must be a mapping, got {type(data).__name__}")])
    return data


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")


def substitute_env(node: Any, path: str, env: Mapping[str, str], source: str) -> Any:
    """Replace ``${VAR}`` / ``${VAR:default}`` in string values. A whole-value reference is parsed as
    YAML, so ``steps: ${STEPS:10}`` stays an int."""
    if isinstance(node, dict):
        return {k: substitute_env(v, f"{path}.{k}" if path else str(k), env, source) for k, v in node.items()}
    if isinstance(node, list):
        return [substitute_env(v, f"{path}[{i}]", env, source) for i, v in enumerate(node)]
    if not isinstance(node, str) or "${" not in node:
        return node

    def value(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        raise ConfigError(
            [
                ConfigIssue(
                    path,
                    f"environment variable {name} is not set and has no default (in {source})",
                    value=node,
                    allowed=f"set {name}, or write ${{{name}:default}}",
                )
            ]
        )

    whole = _VAR.fullmatch(node)
    if whole:
        return parse_scalar(value(whole))
    return _VAR.sub(value, node)


@dataclass
class Layered:
    """The merged raw config and, per leaf key path, the layer that set it."""

    data: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def merge(self, layer: Mapping[str, Any], source: str) -> None:
        _deep_merge(self.data, layer, "", source, self.sources)


def _deep_merge(dst: dict[str, Any], src: Mapping[str, Any], prefix: str, source: str, sources: dict[str, str]) -> None:
    for key, val in src.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(val, Mapping) and val:
            if not isinstance(dst.get(key), dict):
                dst[key] = {}
                _drop_below(sources, path)
                sources.pop(path, None)
            _deep_merge(dst[key], val, path, source, sources)
        else:
            dst[key] = copy.deepcopy(val)
            _drop_below(sources, path)
            sources[path] = source


def _drop_below(sources: dict[str, str], path: str) -> None:
    for stale in [p for p in sources if p.startswith(path + ".")]:
        del sources[stale]


PresetResolver = Callable[[str], Path | None]


def load_layers(
    config: str | Path | None,
    overrides: Iterable[str] = (),
    resolve_preset: PresetResolver | None = None,
    env: Mapping[str, str] | None = None,
    configure: Callable[[dict[str, Any]], list[tuple[str, dict[str, Any]]]] | None = None,
) -> Layered:
    """Load ``config`` (a file path or a preset name) with its ``extends`` chain, then plugin changes
    and command-line overrides."""
    env = os.environ if env is None else env
    out = Layered()
    if config is not None:
        path = _locate(str(config), None, resolve_preset)
        _load_file(path, out, env, resolve_preset, stack=[])
    parsed = [parse_override(item) for item in overrides]
    if configure is not None:
        # plugins see the whole config, overrides included; their changes go under the overrides
        preview = Layered(copy.deepcopy(out.data))
        for key, value in parsed:
            preview.merge(nest(key, coerce(key, value)), "")
        for source, change in configure(preview.data):
            out.merge(change, source)
    for key, value in parsed:
        out.merge(nest(key, coerce(key, value)), "command line")
    return out


def _locate(ref: str, base: Path | None, resolve_preset: PresetResolver | None) -> Path:
    candidates = []
    p = Path(ref).expanduser()
    if not p.is_absolute() and base is not None:
        candidates.append(base / p)
    candidates.append(p)
    for c in candidates:
        if c.is_file():
            return c.resolve()
    name = ref.removeprefix("preset:")
    if resolve_preset is not None:
        found = resolve_preset(name)
        if found is not None:
            return found.resolve()
    where = f" (relative to {base})" if base is not None else ""
    raise ConfigError(
        [
            ConfigIssue(
                "extends" if base else "config",
                f"no file or preset named {ref!r}{where}",
                allowed="a YAML path or a name from `primus presets list`",
            )
        ]
    )


def _load_file(
    path: Path, out: Layered, env: Mapping[str, str], resolve: PresetResolver | None, stack: list[Path]
) -> None:
    if path in stack:
        chain = " -> ".join(p.name for p in [*stack, path])
        raise ConfigError([ConfigIssue("extends", f"cycle: {chain}", value=str(path))])
    data = read_yaml(path)
    parents = data.pop("extends", [])
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(x, str) for x in parents):
        raise ConfigError([ConfigIssue("extends", "must be a path or a list of paths / preset names", value=parents)])
    for parent in parents:
        _load_file(_locate(parent, path.parent, resolve), out, env, resolve, [*stack, path])
    data = substitute_env(data, "", env, str(path))
    out.files.append(str(path))
    out.merge(data, _label(path))


def _label(path: Path) -> str:
    parts = path.parts
    if "presets" in parts:
        i = len(parts) - 1 - parts[::-1].index("presets")
        return "preset " + "/".join(parts[i + 1 :]).removesuffix(".yaml")
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    key = key.strip().removeprefix("--")
    if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise ConfigError([ConfigIssue(item, "an override is written key.sub=value", value=item)])
    return key, parse_scalar(raw) if raw != "" else ""


def nest(dotted: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cur = out
    parts = dotted.split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return out
