"""The planner: per-device memory and step-time models, and the search that ranks parallel layouts."""

from primus.core.planner.hardware import DEVICES, Device, device
from primus.core.planner.memory import KernelTerms, Layout, MemoryBreakdown, estimate
from primus.core.planner.search import Candidate, Cluster, best, candidates

__all__ = [
    "DEVICES",
    "Candidate",
    "Cluster",
    "Device",
    "KernelTerms",
    "Layout",
    "MemoryBreakdown",
    "best",
    "candidates",
    "device",
    "estimate",
]
