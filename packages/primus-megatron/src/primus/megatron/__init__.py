"""Primus backend ``megatron``: trains Primus configs with Megatron-Core 0.16.1 (Python < 3.12) or 0.19.2 (Python >=
3.12; :mod:`primus.megatron.compat` holds what differs).

Importing this package does not import megatron or torch; the engine loads when a run starts.
"""

__version__ = "0.1.0"
