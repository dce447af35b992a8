"""The planner: per-device memory and step-time models, and the search that ranks parallel layouts.

What it knows of an engine comes from the engine's backend (its :class:`EngineProfile`), never from its name.
The names below are imported from their modules on first use."""

from primus.core.contracts.lazy import exports

__all__, __getattr__ = exports(
    __name__,
    hardware="DEVICES Device device",
    memory="KernelTerms Layout MemoryBreakdown estimate",
    engine_profile="GENERIC EngineProfile profile_of",
    search="Candidate Cluster best candidates",
)
