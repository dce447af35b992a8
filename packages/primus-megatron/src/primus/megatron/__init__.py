"""Primus backend ``megatron``: trains Primus configs with Megatron-Core 0.16.1.

Importing this package does not import megatron or torch; the engine loads when a run starts.
"""

__version__ = "0.1.0"
