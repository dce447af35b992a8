"""The plugin host: load every installed ``primus`` entry point, check it, collect what it offers.

A plugin that fails to import, breaks a hookspec, or returns the wrong kind of object is set aside
and reported (``primus plugins`` lists it with its distribution); it never takes the CLI down.

Duplicate names are resolved by one rule, and the loser is logged: the higher ``priority`` wins, then
the distribution whose name sorts first; ``primus-core`` never shadows a plugin (its entries have the
lowest tie-break rank), so a third party can replace a built-in by offering the same name.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import pluggy

from primus.core.contracts import hookspecs
from primus.core.contracts.engine import BackendSpec
from primus.core.contracts.protocols import KERNEL_OPS, KernelProvider, StrategySpec

log = logging.getLogger("primus.plugins")

GROUP = "primus"
DISABLE_ENV = "PRIMUS_DISABLE_PLUGIN_AUTOLOAD"
CORE_DIST = "primus-core"

# Which distribution provides a backend, for "install X" messages when it is missing.
KNOWN_BACKEND_DISTS = {"megatron": "primus-megatron", "torchtitan": "primus-torchtitan"}


class PluginError(RuntimeError):
    """A plugin broke the contract; the message names its distribution."""


@dataclass
class PluginRecord:
    name: str
    dist: str
    version: str
    module: str
    status: str = "ok"  # ok | import-failed | rejected
    error: str = ""
    provides: dict[str, list[str]] = field(default_factory=dict)


def _dist_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ("?", "?")
    return (dist.metadata["Name"], dist.version)


class PrimusPluginManager(pluggy.PluginManager):
    def __init__(self) -> None:
        super().__init__(GROUP)
        self.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}

    def dist_of(self, plugin_name: str) -> str:
        rec = self.records.get(plugin_name)
        return rec.dist if rec else plugin_name

    def each_impl(self, hook_name: str) -> list[tuple[str, pluggy.HookCaller]]:
        """``(plugin name, caller)`` for each implementation of ``hook_name``, in pluggy's call order
        (``tryfirst`` first, ``trylast`` last). A caller calls that one implementation through pluggy (keyword
        arguments matched to its signature, every hookwrapper around it) and returns pluggy's result list,
        so a result or a failure can be put down to its plugin."""
        impls = [i for i in reversed(getattr(self.hook, hook_name).get_hookimpls()) if not (i.wrapper or i.hookwrapper)]
        return [
            (impl.plugin_name, self.subset_hook_caller(hook_name, [o.plugin for o in impls if o is not impl]))
            for impl in impls
        ]

    def register_checked(self, plugin: Any, name: str, dist: str, version: str, module: str) -> None:
        rec = PluginRecord(name=name, dist=dist, version=version, module=module)
        self.records[name] = rec
        try:
            self.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            rec.status, rec.error = "rejected", f"{dist}: {exc}"
            log.error("plugin %s (%s) rejected: %s", name, dist, exc)
            return
        unknown = [
            impl.function.__name__
            for caller in (self.get_hookcallers(plugin) or [])
            for impl in caller.get_hookimpls()
            if impl.plugin is plugin and not caller.has_spec()
        ]
        if unknown:
            self.unregister(plugin)
            rec.status = "rejected"
            rec.error = f"{dist}: implements hooks that Primus does not define: {', '.join(unknown)}"
            log.error("plugin %s rejected: %s", name, rec.error)
            return
        for caller in self.get_hookcallers(plugin) or []:
            if caller.spec is not None and caller.spec.warn_on_impl is not None:
                # pluggy's DeprecationWarning is hidden outside tests (not raised in __main__): log it too
                log.warning("plugin %s (%s): %s", name, dist, caller.spec.warn_on_impl)

    def load_entrypoints(self, only: str | None = None, force: bool = False) -> None:
        """Every ``primus`` entry point unless autoload is off (``force``: even then); ``only``: that one, read
        whatever the switch (core's own plugin)."""
        if os.environ.get(DISABLE_ENV) and only is None and not force:
            return
        seen: set[str] = set()
        for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
            if only is not None and ep.name != only:
                continue
            if ep.name in seen:
                continue
            seen.add(ep.name)
            dist, version = _dist_of(ep)
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - one broken plugin must not take the CLI down
                self.records[ep.name] = PluginRecord(
                    ep.name, dist, version, ep.value, "import-failed", f"{type(exc).__name__}: {exc}"
                )
                log.warning("plugin %s (%s) failed to import: %s", ep.name, dist, exc)
                continue
            self.register_checked(plugin, ep.name, dist, version, ep.value)


def build_plugin_manager(
    extra_plugins: Sequence[tuple[str, Any]] = (), autoload: bool | None = None
) -> PrimusPluginManager:
    """Specs → installed entry points (``autoload`` None: unless switched off by the environment) → core's own
    plugin, found by its entry point like any other (the host imports no room above it) → extras."""
    pm = PrimusPluginManager()
    if autoload is not False:
        pm.load_entrypoints(force=bool(autoload))
    if "core" not in pm.records:
        pm.load_entrypoints(only="core")
    for name, plugin in extra_plugins:
        pm.register_checked(plugin, name, name, "", getattr(plugin, "__name__", repr(plugin)))
    pm.hook.primus_addhooks.call_historic(kwargs={"pluginmanager": pm})
    return pm


def _collect(pm: PrimusPluginManager, hook_name: str, kind: type) -> list[tuple[str, Any]]:
    """Call each implementation alone (through pluggy) so a failure or a bad return names its distribution."""
    out: list[tuple[str, Any]] = []
    for plugin_name, call in pm.each_impl(hook_name):
        dist = pm.dist_of(plugin_name)
        rec = pm.records.get(plugin_name)
        try:
            items = [item for result in call() for item in (result or [])]
            bad = [x for x in items if not isinstance(x, kind)]
            if bad:
                raise PluginError(f"{hook_name} returned {type(bad[0]).__name__}, expected {kind.__name__}")
        except Exception as exc:  # noqa: BLE001
            msg = f"{dist}: {hook_name} failed: {exc}"
            log.error(msg)
            if rec is not None:
                rec.status, rec.error = "rejected", msg
            continue
        for item in items:
            out.append((dist, item))
        if rec is not None:
            label = hook_name.removeprefix("primus_")
            rec.provides.setdefault(label, []).extend(_label(x) for x in items)
    return out


def _label(item: Any) -> str:
    if isinstance(item, tuple) and item:
        return str(item[0])
    if isinstance(item, KernelProvider):
        return f"{item.op}:{item.name}"
    if isinstance(item, Path):
        return str(item)
    return getattr(item, "name", str(item))


def _rank(dist: str, priority: int) -> tuple[int, int, str]:
    # higher priority first; then plugins before core; then distribution name
    return (-priority, 1 if dist == CORE_DIST else 0, dist)


class Registry:
    """Everything the installed plugins offer, with duplicates resolved."""

    def __init__(self, pm: PrimusPluginManager):
        self.pm = pm
        self.shadowed: list[str] = []

    def _pick(self, items: list[tuple[str, Any]], key: Any) -> dict[Any, Any]:
        chosen: dict[Any, Any] = {}
        for dist, item in sorted(items, key=lambda di: _rank(di[0], getattr(di[1], "priority", 0))):
            item = replace(item, dist=dist)
            k = key(item)
            if k in chosen:
                msg = f"{k} from {dist} is shadowed by {chosen[k].dist} (priority, then distribution name)"
                self.shadowed.append(msg)
                log.info(msg)
                continue
            chosen[k] = item
        return chosen

    @cached_property
    def backends(self) -> dict[str, BackendSpec]:
        return self._pick(_collect(self.pm, "primus_backends", BackendSpec), lambda b: b.name)

    @cached_property
    def strategies(self) -> dict[str, StrategySpec]:
        return self._pick(_collect(self.pm, "primus_strategies", StrategySpec), lambda s: s.name)

    @cached_property
    def kernels(self) -> dict[tuple[str, str], KernelProvider]:
        items = _collect(self.pm, "primus_kernels", KernelProvider)
        for dist, k in items:
            if k.op not in KERNEL_OPS:
                log.error("%s: kernel provider %s has unknown op %r (allowed: %s)", dist, k.name, k.op, KERNEL_OPS)
        return self._pick([(d, k) for d, k in items if k.op in KERNEL_OPS], lambda k: (k.op, k.name))

    @cached_property
    def commands(self) -> list[tuple[str, Any]]:
        out = []
        for dist, item in _collect(self.pm, "primus_commands", tuple):
            if len(item) == 2 and isinstance(item[0], str):
                out.append(item)
            else:
                log.error("%s: primus_commands must return (name, typer.Typer) pairs, got %r", dist, item)
        return out

    @cached_property
    def loggers(self) -> list[str]:
        """Installed loggers: the plugins that implement ``primus_on_log``, by plugin (entry-point) name, the key a
        run names them by under ``logging.loggers``; core's own console logger is always on and is none of them."""
        names = sorted({impl.plugin_name for impl in self.pm.hook.primus_on_log.get_hookimpls()} - {"core"})
        for name in names:
            if (rec := self.pm.records.get(name)) is not None:
                rec.provides["loggers"] = [name]
        return names

    def kernel_names(self, op: str) -> set[str]:
        return {name for (o, name) in self.kernels if o == op}

    def providers(self, op: str) -> list[KernelProvider]:
        """Providers of ``op``, best first (priority, then name for a stable order)."""
        return sorted((k for (o, _), k in self.kernels.items() if o == op), key=lambda k: (-k.priority, k.name))

    @cached_property
    def preset_dirs(self) -> list[tuple[str, Path]]:
        dirs = _collect(self.pm, "primus_presets", Path)
        # plugins before core, so a plugin's preset of the same name wins (logged in presets.py)
        return sorted(dirs, key=lambda dp: _rank(dp[0], 0))

    def missing_backend_message(self, name: str) -> str:
        dist = KNOWN_BACKEND_DISTS.get(name)
        failed = [r for r in self.pm.records.values() if r.status != "ok" and (dist is None or r.dist == dist)]
        if dist and failed:
            return f"backend {name!r} is provided by {dist}, which is installed but did not load: {failed[0].error}"
        if dist:
            return f"backend {name!r} is not installed: pip install {dist}"
        return f"unknown backend {name!r}"


_cached: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    global _cached
    if _cached is None or refresh:
        _cached = Registry(build_plugin_manager())
    return _cached
