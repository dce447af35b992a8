"""The planner: per-device memory and step-time models, and the search that ranks parallel layouts.

What it knows of an engine comes from the engine's backend (its :class:`EngineProfile`), never from its name."""

from primus.core.planner.hardware import DEVICES, Device, device
from primus.core.planner.memory import KernelTerms, Layout, MemoryBreakdown, estimate
from primus.core.planner.profile import GENERIC, EngineProfile, profile_of
from primus.core.planner.search import Candidate, Cluster, best, candidates

__all__ = [
    "DEVICES",
    "GENERIC",
    "Candidate",
    "Cluster",
    "Device",
    "EngineProfile",
    "KernelTerms",
    "Layout",
    "MemoryBreakdown",
    "best",
    "candidates",
    "device",
    "estimate",
    "profile_of",
]
