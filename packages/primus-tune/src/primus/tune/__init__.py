"""Primus tuning: recipes with settings chosen from measurements, and where GEMM tuning results live."""

__version__ = "0.1.0"
