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
from types import NoneType, UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from primus.core.config.errors import ConfigError
from primus.core.config.fields import coerce
from primus.core.config.schema import PrimusConfig, ScheduleConfig
from primus.core.config.yaml_reader import Loader, YAMLRefused
from primus.core.contracts.protocols import ConfigIssue

_Loader = Loader  # SafeLoader with a config's limits (yaml_reader)
# the source of logging.output_dir's default, outputs/<the recipe's or config file's name>, under every layer
RECIPE_NAME = "default: the recipe's name"
WARMUP = "train.schedule.warmup_steps"


def parse_scalar(text: str) -> Any:
    """Parse one YAML scalar (command-line values, ``${VAR}`` values)."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except (yaml.YAMLError, ValueError):  # ValueError: an int of more than 4300 digits
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
    except YAMLRefused as exc:
        raise ConfigError([ConfigIssue(str(path), str(exc))]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigIssue(str(path), f"not valid YAML: {exc}")]) from None
    except RecursionError:  # the reader's depth limit comes first; this is the last guard
        raise ConfigError([ConfigIssue(str(path), "nested too deeply to read")]) from None
    except ValueError as exc:  # what PyYAML's constructors let through: an int of more than 4300 digits
        raise ConfigError([ConfigIssue(str(path), f"a value cannot be read: {exc}")]) from None
    if data is None:  # an empty file (or comments only) is a mistake, not a request for every default
        raise ConfigError(
            [
                ConfigIssue(
                    str(path), "is empty (no keys)", allowed="a mapping of config sections, e.g. train: {steps: 10}"
                )
            ]
        )
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue(str(path), f"top level must be a mapping, got {type(data).__name__}")])
    return data


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")


def substitute_env(
    node: Any, path: str, env: Mapping[str, str], source: str, done: dict[int, Any] | None = None
) -> Any:
    """Replace ``${VAR}`` / ``${VAR:default}`` in string values. A whole-value reference is parsed as
    YAML, so ``steps: ${STEPS:10}`` stays an int. A mapping or list that YAML aliases share is substituted once
    and stays shared (``done``, by identity): an alias is never expanded into copies here."""
    done = {} if done is None else done
    if isinstance(node, dict | list):
        if id(node) in done:
            return done[id(node)]
        if isinstance(node, dict):
            out: Any = done.setdefault(id(node), {})
            for k, v in node.items():
                out[k] = substitute_env(v, f"{path}.{k}" if path else str(k), env, source, done)
        else:
            out = done.setdefault(id(node), [])
            out.extend(substitute_env(v, f"{path}[{i}]", env, source, done) for i, v in enumerate(node))
        return out
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
    notes: list[str] = field(default_factory=list)  # values the loader changed, for the CLI to say

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
        # the run folder is named for what was run: tiny-demo and tiny-demo-megatron (one model) get two folders
        out.merge({"logging": {"output_dir": str(Path("outputs") / path.stem)}}, RECIPE_NAME)
        _load_file(path, out, env, resolve_preset, stack=[])
    parsed = [parse_override(item) for item in overrides]
    if configure is not None:
        # plugins see the whole config, overrides included; their changes go under the overrides
        preview = Layered(copy.deepcopy(out.data))
        for key, value in parsed:
            preview.merge(nest(key, coerce(key, value)), "command line")
        if issues := section_issues(preview.data, {**out.sources, **preview.sources}):
            raise ConfigError(issues)  # before plugins read a section that is not one
        for source, change in configure(preview.data):
            out.merge(change, source)
    for key, value in parsed:
        out.merge(nest(key, coerce(key, value)), "command line")
    if issues := section_issues(out.data, out.sources):
        raise ConfigError(issues)
    _cap_warmup(out)
    return out


def _cap_warmup(out: Layered) -> None:
    """``train.steps=N`` on the command line under a recipe's warmup (a 2-step smoke run of a recipe that warms up
    for 5) takes the warmup down to N, with a note; both given on the command line stay as given (the validator
    refuses the contradiction)."""
    steps = out.data.get("train", {}).get("steps")
    schedule = out.data.get("train", {}).get("schedule") or {}
    warmup = schedule.get("warmup_steps", ScheduleConfig.model_fields["warmup_steps"].default)
    capped = out.sources.get("train.steps") == "command line" and out.sources.get(WARMUP) != "command line"
    if not (capped and type(steps) is int and type(warmup) is int and 0 <= steps < warmup):
        return
    was = out.sources.get(WARMUP, "default")
    out.merge(nest(WARMUP, steps), f"command line (train.steps={steps})")
    out.notes.append(f"{WARMUP}: {warmup} from {was} is more than train.steps={steps}; warming up for {steps}")


def _section_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The section model a field holds (``train: TrainConfig``, ``moe: MoEConfig | None``) and whether null is
    allowed; (None, False) for any other field (a list of models is not a section)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not NoneType]
        if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            return args[0], NoneType in get_args(annotation)
    return None, False


def section_issues(data: Mapping[str, Any], sources: Mapping[str, str], model: Any = None, prefix: str = ""):
    """Each section (a key the schema holds a mapping under) given a scalar or a list, named with the layer that
    set it: refused here, before code that reads the raw layers (``train.init_from``) looks inside it."""
    model = PrimusConfig if model is None else model
    issues: list[ConfigIssue] = []
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        section, nullable = _section_model(field.annotation) if field is not None else (None, False)
        if section is None:
            continue  # not a section; unknown keys are the schema's to name
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            issues += section_issues(value, sources, section, path)
        elif not (value is None and nullable):
            where = f" (set by {sources[path]})" if path in sources else ""
            allowed = f"a mapping of {section.__name__} keys, e.g. {path}: {{...}}" + (" or null" if nullable else "")
            issues.append(
                ConfigIssue(path, f"must be a mapping of keys, not {type(value).__name__}{where}", value, allowed)
            )
    return issues


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
