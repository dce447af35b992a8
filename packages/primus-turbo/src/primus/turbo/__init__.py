"""Primus kernel providers for GPUs: faster attention than core's default, picked per device.

Nothing here imports torch or a vendor library at import time: providers name their callables as
``"module:attr"`` strings, and the availability checks import torch only for a GPU device.
"""

__version__ = "0.1.0"
