"""Primus core: contracts (pluggy hookspecs), config, presets, CLI, planner, launcher.

Importing this package imports neither torch nor any engine.
"""

import pluggy

__version__ = "0.1.0"

#: Marker for plugin hook implementations: ``@primus.core.hookimpl def primus_backends(): ...``
hookimpl = pluggy.HookimplMarker("primus")

__all__ = ["__version__", "hookimpl"]
