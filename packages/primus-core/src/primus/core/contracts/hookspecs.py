"""Primus hook specifications: the one contract every plugin implements against.

Plugins are found through the entry-point group ``primus``; each entry point names a module (or
object) whose functions are marked with :data:`primus.core.hookimpl`. Hooks are always called with
keyword arguments, so an implementation may accept fewer arguments than its spec (new arguments
break no plugin).

Groups, in the order a run meets them: registration, contributions (what a plugin offers),
configuration, and the training lifecycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pathlib import Path

    from primus.core.config.schema import PrimusConfig
    from primus.core.contracts.engine import BackendSpec, RunInfo
    from primus.core.contracts.protocols import ConfigIssue, KernelProvider, StrategySpec

hookspec = pluggy.HookspecMarker("primus")

# -------------------------------------------------------------------------------------------------
# Registration hooks
# -------------------------------------------------------------------------------------------------


@hookspec(historic=True)
def primus_addhooks(pluginmanager: pluggy.PluginManager) -> None:
    """Add hook specifications of a plugin's own (e.g. backend-specific hooks).

    Historic: a plugin registered later is called at once.

    :param pluginmanager: the Primus plugin manager; call ``pluginmanager.add_hookspecs(module)``.

    Use in plugins: called once, when the plugin manager is built.
    """


# -------------------------------------------------------------------------------------------------
# Contribution hooks: what a plugin offers. Each returns a list; results of all plugins are
# collected and checked by primus.core.contracts.plugins (duplicates resolved there, by a logged rule).
# -------------------------------------------------------------------------------------------------


@hookspec
def primus_backends() -> list[BackendSpec]:
    """Training backends this plugin provides.

    :returns: a list of :class:`primus.core.contracts.engine.BackendSpec`.

    Use in plugins: called when the registry is first built (``primus plugins``, ``primus train``).
    Must not import the engine: a spec names its ``engine`` builder and ``validate`` as ``"module:attr"``,
    and its Hugging Face importer/exporter (``hf``, see :class:`primus.core.hf.contract.HFInterop`) too.
    """


@hookspec
def primus_kernels() -> list[KernelProvider]:
    """Kernel providers this plugin offers (attention, rms_norm, swiglu, cross_entropy, rope, gemm).

    :returns: a list of :class:`primus.core.contracts.protocols.KernelProvider`.

    Use in plugins: called when kernels are selected for a run, and by ``primus plugins``.
    """


@hookspec
def primus_strategies() -> list[StrategySpec]:
    """Parallel strategies (ddp, fsdp2, tp_pp_vpp, ...) this plugin provides.

    :returns: a list of :class:`primus.core.contracts.protocols.StrategySpec`.

    Use in plugins: called when the parallel section is planned.
    """


@hookspec
def primus_presets() -> list[Path]:
    """Folders of YAML presets. Files under ``models/`` are model presets, under ``recipes/`` recipes.

    :returns: a list of folders (``pathlib.Path``).

    Use in plugins: called when a preset name is resolved and by ``primus presets``.
    """


@hookspec
def primus_commands() -> list[tuple[str, Any]]:
    """Command groups this plugin adds to the ``primus`` CLI.

    :returns: a list of ``(name, typer.Typer)``; ``primus NAME ...`` runs the group. A name that core
        or a plugin called earlier (``tryfirst``, else the one registered last) already uses is refused
        and logged.

    Use in plugins: called when the CLI starts. Import nothing heavy (torch, an engine) at module
    level of the command module: ``primus --help`` must stay fast.
    """


# -------------------------------------------------------------------------------------------------
# Configuration hooks
# -------------------------------------------------------------------------------------------------


@hookspec
def primus_configure(config: dict[str, Any]) -> dict[str, Any] | None:
    """Change the merged config before it is validated.

    :param config: the merged, not yet validated config, overrides included (a plain nested dict).
    :returns: ``None``, or a mapping of dotted keys (``"kernels.gemm_tuning"``) to values. These are
        applied on top of the config files (command-line overrides still win), and ``primus config
        show`` names the plugin's distribution as their source. Where two plugins set one key, the one
        called first wins (``tryfirst``, else the one registered last).

    Use in plugins: called once per config load, after layering, before validation.
    """


@hookspec
def primus_check_run(config: PrimusConfig) -> list[ConfigIssue] | None:
    """Refuse what this plugin cannot do for a run of ``config`` on this machine, before anything is written.

    :param config: the validated config of the run.
    :returns: ``None`` or an empty list to accept; else one
        :class:`primus.core.contracts.protocols.ConfigIssue` per reason (the key, its value, what is allowed).
        ``primus train`` prints them all and exits 2, with no run folder written.

    Use in plugins: called once by ``primus train`` (the launcher, before the ranks start), after the config
    and the run folder are checked. A check that needs this machine's device calls
    :func:`primus.core.kernels.selection.detect_device`, which imports torch: do it only when the plugin's feature is on.
    """


# -------------------------------------------------------------------------------------------------
# Lifecycle hooks: observe a run. Called on every rank (``info.rank`` says which), in this order:
# model_ready -> train_start -> (optimizer_step every step, log every logging interval)* -> train_end.
# -------------------------------------------------------------------------------------------------


@hookspec
def primus_on_model_ready(config: PrimusConfig, model_parts: list[Any], info: RunInfo) -> None:
    """The engine has built the model (parallelized it, and compiled it where asked).

    :param config: the validated config.
    :param model_parts: the engine's model modules (one per pipeline chunk on this rank). A plugin may
        change how their modules compute (e.g. route linears through tuned GEMMs), never their parameters.
    :param info: world size, rank, device, kernel choices, parameter count, output folder.

    Use in plugins: called once per run, before any checkpoint is loaded and before any step.
    """


@hookspec
def primus_on_train_start(config: PrimusConfig, info: RunInfo) -> None:
    """A run starts.

    :param config: the validated config.
    :param info: as in ``primus_on_model_ready``.

    Use in plugins: called once per run, after the engine is built and its state loaded (when the run
    resumes), before the first step of this run.
    """


@hookspec
def primus_on_optimizer_step(step: int, info: RunInfo) -> None:
    """An optimizer step finished. Keep it cheap: it runs on every step; metrics come with ``primus_on_log``.

    :param step: the step just finished (1-based).
    :param info: as in ``primus_on_model_ready``.

    Use in plugins: called after every optimizer step, before that step's ``primus_on_log`` (if any).
    """


@hookspec
def primus_on_log(step: int, metrics: dict[str, float], info: RunInfo) -> None:
    """The metrics of a logging interval (loggers, alerts, dashboards).

    :param step: the step just finished (1-based), the last of the interval.
    :param metrics: loss, grad_norm, lr, tokens_per_s, tflops_per_device, mfu, memory_gib, ...
    :param info: as in ``primus_on_model_ready``.

    Use in plugins: called every ``logging.interval`` steps and at the last step, after that step's
    ``primus_on_optimizer_step``.
    """


@hookspec
def primus_on_train_end(summary: dict[str, Any], info: RunInfo) -> None:
    """The run ended.

    :param summary: final step, status, last metrics, checkpoint path. ``summary["status"]`` says whether
        the run finished or failed.
    :param info: as in ``primus_on_model_ready``.

    Use in plugins: called once per run, after the last step, or after an error.
    """
