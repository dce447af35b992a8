"""Primus's TorchTitan backend: a Primus config run on TorchTitan's own Trainer (torchtitan 0.2.2)."""

__version__ = "0.1.0"
