"""Old module paths (``primus.core.loop`` ...) from before core was split into rooms: importing one gives the
module at its new path (the same object, so patching either patches both), with a DeprecationWarning."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {
    "primus.core.cli_analyze": "primus.core.cli.analyze",
    "primus.core.cli_checkpoint": "primus.core.cli.checkpoint",
    "primus.core.cli_data": "primus.core.cli.data",
    "primus.core.cli_eval": "primus.core.cli.eval",
    "primus.core.cli_helpers": "primus.core.cli.helpers",
    "primus.core.cli_plan": "primus.core.cli.plan",
    "primus.core.cli_preflight": "primus.core.cli.preflight",
    "primus.core.cli_profile": "primus.core.cli.profile",
    "primus.core.cli_slurm": "primus.core.cli.slurm",
    "primus.core.cli_train": "primus.core.cli.train",
    "primus.core.torchrun": "primus.core.launch.torchrun",
    "primus.core.slurm": "primus.core.launch.slurm",
    "primus.core.launch_env": "primus.core.launch.env",
    "primus.core.preflight": "primus.core.launch.preflight",
    "primus.core.run_checks": "primus.core.launch.run_checks",
    "primus.core.train": "primus.core.launch.train",
    "primus.core.loop": "primus.core.run.loop",
    "primus.core.checkpoints": "primus.core.run.checkpoints",
    "primus.core.health": "primus.core.run.health",
    "primus.core.schedule": "primus.core.run.schedule",
    "primus.core.stop": "primus.core.run.stop",
    "primus.core.metrics": "primus.core.run.metrics",
    "primus.core.runlog": "primus.core.run.runlog",
    "primus.core.rundir": "primus.core.run.rundir",
    "primus.core.evaluation": "primus.core.run.evaluation",
    "primus.core.init": "primus.core.run.init",
    "primus.core.init_from": "primus.core.run.init_from",
    "primus.core.faults": "primus.core.run.faults",
    "primus.core.expert_load": "primus.core.run.expert_load",
    "primus.core.lazy_compile": "primus.core.run.lazy_compile",
    "primus.core.testing": "primus.core.run.testing",
    "primus.core.strategies": "primus.core.planner.strategies",
    "primus.core.modelmath": "primus.core.planner.modelmath",
    "primus.core.planner.ranking": "primus.core.launch.ranking",
    "primus.core.presets": "primus.core.config.presets",
    "primus.core.hookspecs": "primus.core.contracts.hookspecs",
    "primus.core.protocols": "primus.core.contracts.protocols",
    "primus.core.errors": "primus.core.contracts.errors",
    "primus.core.plugins": "primus.core.contracts.plugins",
    "primus.core.patches": "primus.core.contracts.patches",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in MOVED else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        new = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} moved to {new}", DeprecationWarning, stacklevel=2)
        # the import system returns whatever sys.modules holds for the name once this returns
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        # first: ``primus.core.presets`` would otherwise be found as the namespace package of the presets folder
        sys.meta_path.insert(0, _Alias())
