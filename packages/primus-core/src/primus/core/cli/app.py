"""The ``primus`` command. Importing this module imports neither torch nor an engine (fast --help)."""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

import typer
from rich.table import Table

from primus.core.cli.helpers import Overrides, WorldSize, err, fail, out, resolve_or_exit
from primus.core.contracts.errors import UserError

config_app = typer.Typer(help="Resolve, show and validate configs.", no_args_is_help=True)
presets_app = typer.Typer(help="Model and recipe presets.", no_args_is_help=True)

# Every built-in command, in the order a user meets them (train first): its name -> "module:attribute", a function
# (a command) or a Typer (a group). A run imports only the module of the command it runs (`primus train` does not
# import the planner); help and the test runner's full `app` import them all.
COMMANDS = {
    "train": "primus.core.cli.train:train",
    "eval": "primus.core.cli.eval:evaluate",
    "plan": "primus.core.cli.plan:plan",
    "profile": "primus.core.cli.profile:profile",
    "analyze": "primus.core.cli.analyze:analyze",
    "preflight": "primus.core.cli.preflight:preflight",
    "config": "primus.core.cli.app:config_app",
    "presets": "primus.core.cli.app:presets_app",
    "data": "primus.core.cli.data:data_app",
    "checkpoint": "primus.core.cli.checkpoint:checkpoint_app",
    "slurm": "primus.core.cli.slurm:slurm_app",
    "plugins": "primus.core.cli.app:plugins",
    "env": "primus.core.cli.app:env",
}


def build(only: str | None = None) -> typer.Typer:
    """The ``primus`` app with every built-in command, or with ``only`` that one (what a run of it needs); plugin
    command groups are added by :func:`add_plugin_commands`."""
    import importlib

    app = typer.Typer(
        help="Primus: one config and one CLI over Megatron-Core and TorchTitan.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    app.callback()(_main)
    for name, target in COMMANDS.items():
        if only is None or name == only:
            module, _, attr = target.partition(":")
            obj = getattr(importlib.import_module(module), attr)
            if isinstance(obj, typer.Typer):
                app.add_typer(obj, name=name)
            else:
                app.command(name)(obj)
    plain_help(app)
    return app


def __getattr__(name: str) -> Any:
    if name == "app":  # the whole app, built on first use (tests drive it with typer's CliRunner)
        globals()["app"] = whole = build()
        add_plugin_commands(whole)
        return whole
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _version_callback(value: bool) -> None:
    if value:
        out.print(f"primus {_version('primus-core')}", highlight=False)
        raise typer.Exit()


def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """Primus: one config and one CLI over Megatron-Core and TorchTitan."""


# ------------------------------------------------------------------------------------------------ config


@config_app.command("show")
def config_show(
    config: Annotated[str | None, typer.Argument(help="a YAML file or a preset name")] = None,
    overrides: Overrides = None,
    world_size: WorldSize = None,
    sources: Annotated[bool, typer.Option(help="show the layer each value came from")] = True,
    as_yaml: Annotated[bool, typer.Option("--yaml", help="print plain YAML")] = False,
) -> None:
    """Print the resolved config and, per value, the layer it came from."""
    import yaml

    from primus.core.config.fields import describe

    res = resolve_or_exit(config, overrides, world_size, check_plugins=False)
    data = res.config.model_dump(mode="json")
    if as_yaml:
        out.print(yaml.safe_dump(data, sort_keys=False), end="", highlight=False)
        return
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    labels = set(res.layers.sources.values()) | {"default", "resolved (world size)"}
    table.add_column("key", no_wrap=True)
    table.add_column("value", no_wrap=True)  # a value is never cut; the description gives way
    if sources:
        table.add_column("from", style="cyan", no_wrap=True, min_width=max(map(len, labels)))
    table.add_column("description", style="dim", overflow="ellipsis")
    for key, value in _flatten(data):
        src = res.layers.sources.get(key) or next(
            (s for p, s in res.layers.sources.items() if key.startswith(p + ".")), None
        )
        if src is None and key in ("parallel.dp_shard", "train.global_batch_size"):
            src = "resolved (world size)"
        row = [key, json.dumps(value)] + ([src or "default"] if sources else []) + [describe(key)]
        table.add_row(*row)
    out.print(table)
    from primus.core.config.validate import registry_issues

    for issue in registry_issues(res.config, res.registry, res.world_size):
        err.print(f"warning: {issue}", style="yellow", highlight=False, markup=False)


def _flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(data, dict) and data and not prefix.endswith("extra"):
        rows: list[tuple[str, Any]] = []
        for k, v in data.items():
            rows += _flatten(v, f"{prefix}.{k}" if prefix else k)
        return rows
    return [(prefix, data)]


@config_app.command("validate")
def config_validate(
    config: Annotated[str, typer.Argument(help="a YAML file or a preset name")],
    overrides: Overrides = None,
    world_size: WorldSize = None,
) -> None:
    """Check a config against the schema, the world size and the installed plugins, and that its run folder
    (logging.output_dir, checkpoint.dir) can be written."""
    from primus.core.cli.plan import recipe_cluster
    from primus.core.run.rundir import RunFolder

    if world_size is None and (cluster := recipe_cluster(config, overrides or [])) is not None:
        world_size = cluster.world_size  # the recipe's own cluster (nodes × GPUs per node)
    res = resolve_or_exit(config, overrides, world_size)
    try:
        RunFolder(res.config).check_writable()
    except UserError as exc:
        raise fail(exc) from None
    out.print(
        f"ok: {res.config.model.name} on backend {res.config.backend.name}, world size {res.world_size}, "
        f"parallel {res.config.parallel.sizes()}",
        highlight=False,
    )


# ------------------------------------------------------------------------------------------------ presets


@presets_app.command("list")
def presets_list() -> None:
    """Model presets (params, shape) and recipes."""
    from primus.core.config.loader import load_layers
    from primus.core.config.presets import catalog, resolver
    from primus.core.config.schema import ModelConfig
    from primus.core.contracts.plugins import get_registry
    from primus.core.planner.modelmath import count_params, human

    reg = get_registry()
    cat = catalog(reg)
    models = Table(
        "name", "params", "active", "layers", "hidden", "heads", "kv heads", "ffn", "vocab", "from",
        title="models", box=None,
    )  # fmt: skip
    recipes = Table("name", "model", "backend", "description", "from", title="recipes", box=None)
    rows = []
    for p in cat.values():
        data = load_layers(str(p.path), resolve_preset=resolver(reg)).data
        m = ModelConfig.model_validate(data.get("model", {}))
        if p.kind == "model":
            rows.append((m.name.startswith("tiny") is False, count_params(m), p, m))
        else:
            recipes.add_row(
                p.name, m.name, data.get("backend", {}).get("name", "torchtitan"), data.get("description", ""), p.dist
            )
    for _, n, p, m in sorted(rows, key=lambda r: (r[0], r[1].total)):  # tiny presets first, then by size
        models.add_row(
            p.name,
            human(n.total),
            human(n.active),
            str(m.num_layers),
            str(m.hidden_size),
            str(m.num_attention_heads),
            str(m.num_kv_heads),
            str(m.ffn_hidden_size) if m.moe is None else f"{m.moe.num_experts}×{m.moe.expert_ffn_hidden_size}",
            str(m.vocab_size),
            p.dist,
        )
    out.print(models)
    out.print(recipes)


@presets_app.command("show")
def presets_show(name: Annotated[str, typer.Argument(help="preset name")]) -> None:
    """The whole preset, with its extends chain resolved."""
    import yaml

    from primus.core.config.loader import load_layers
    from primus.core.config.presets import catalog, find, resolver
    from primus.core.contracts.plugins import get_registry

    reg = get_registry()
    preset = find(name, reg)
    if preset is None:
        from primus.core.config.fields import suggest

        hint = suggest(name, list(catalog(reg)))
        raise fail(ValueError(f"no preset named {name!r}" + (f"; did you mean {hint!r}?" if hint else "")))
    layers = load_layers(str(preset.path), resolve_preset=resolver(reg))
    out.print(f"# {preset.kind} preset {preset.name} ({preset.dist}): {preset.path}", highlight=False)
    out.print(yaml.safe_dump(layers.data, sort_keys=False), end="", highlight=False)


# ------------------------------------------------------------------------------------------------ plugins, env


def plugins() -> None:
    """Installed plugins: distribution, version, what each provides, and any that failed (then exit 1)."""
    from primus.core.contracts.plugins import get_registry

    reg = get_registry()
    _ = reg.backends, reg.kernels, reg.strategies, reg.preset_dirs, reg.loggers  # collect, so failures are recorded
    table = Table("plugin", "distribution", "version", "status", "provides", box=None)
    for rec in reg.pm.records.values():
        provides = "; ".join(f"{k}: {', '.join(v)}" for k, v in rec.provides.items())
        status = rec.status if rec.status == "ok" else f"{rec.status}: {rec.error}"
        table.add_row(rec.name, rec.dist, rec.version, status, provides)
    out.print(table)
    for msg in reg.shadowed:
        out.print(f"shadowed: {msg}", highlight=False)
    if any(rec.status != "ok" for rec in reg.pm.records.values()):
        raise typer.Exit(1)  # an installed plugin that does not load is broken, not optional


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def env() -> None:
    """Versions of Python, torch, the engines and Primus packages, and the devices found."""
    table = Table("component", "version", box=None)
    table.add_row("python", platform.python_version())
    for dist in (
        "torch",
        "megatron-core",
        "torchtitan",
        "triton",
        "primus-core",
        "primus-megatron",
        "primus-torchtitan",
        "primus-turbo",
        "primus-tune",
        "primus-loggers",
    ):
        table.add_row(dist, _version(dist))
    try:
        import torch

        if torch.cuda.is_available():
            kind = (
                "rocm " + str(torch.version.hip)
                if getattr(torch.version, "hip", None)
                else f"cuda {torch.version.cuda}"
            )
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                table.add_row(f"device {i}", f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {kind})")
        else:
            table.add_row("devices", f"cpu only ({os.cpu_count()} cores)")
    except ImportError:
        table.add_row("devices", "unknown (torch not installed)")
    out.print(table)


def add_plugin_commands(app: typer.Typer) -> None:
    """Mount the command groups plugins offer (primus_commands); a clash with a built-in name is refused."""
    from primus.core.contracts.plugins import get_registry

    taken = set(COMMANDS)
    for name, group in get_registry().commands:
        if name in taken:
            logging.getLogger("primus.plugins").error("command group %r is already taken; not added", name)
            continue
        plain_help(group)
        app.add_typer(group, name=name)
        taken.add(name)


def plain_help(group: typer.Typer) -> None:
    """Help text as the terminal shows it: docstrings without reStructuredText markup (``x``, :mod:`x`), one
    paragraph per blank line, and the first sentence in command lists."""
    import re

    for info in group.registered_commands:
        doc = info.help or (info.callback.__doc__ if info.callback else None)
        if not doc:
            continue
        doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc).replace("``", "")
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc.strip())]
        info.help = "\n\n".join(paragraphs)
        info.short_help = info.short_help or re.split(r"(?<=\.)\s", paragraphs[0])[0].rstrip(".")
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            plain_help(sub.typer_instance)


def main() -> None:
    """Run the command ``sys.argv`` names, importing only its module; anything else (help, a plugin's group, a
    typo: click's error lists the names) gets the whole app."""
    first = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    try:
        if first in COMMANDS:
            build(only=first)()
        else:
            whole = build()
            add_plugin_commands(whole)
            whole()
    except UserError as exc:
        err.print(f"error: {exc}", style="red", highlight=False, markup=False)
        sys.exit(2)


def entry() -> None:
    """The ``primus`` command: :func:`main`, then out without the interpreter's teardown (a second of CPU a process
    once torch is imported: :mod:`primus.core.launch.quick_exit`). :func:`main` itself raises ``SystemExit``."""
    from primus.core.launch.quick_exit import exit_code, quick_exit

    try:
        main()
    except SystemExit as exc:
        quick_exit(exit_code(exc.code))
    quick_exit(0)


if __name__ == "__main__":
    entry()
