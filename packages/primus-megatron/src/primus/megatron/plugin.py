"""Registers the ``megatron`` backend with Primus (entry point ``megatron`` of group ``primus``)."""

from __future__ import annotations

from primus.core import hookimpl
from primus.core.contracts.engine import BackendSpec
from primus.megatron.validate import FAMILIES


@hookimpl
def primus_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="megatron",
            description="Megatron-Core 0.16.1 (Python < 3.12) or 0.19.2 (Python >= 3.12): GPTModel with a kernel layer "
            "spec, DDP + distributed optimizer, TP/SP, PP 1F1B / interleaved, recompute, dist_checkpointing, profiling, "
            "health checks",
            engine="primus.megatron.engine:build",
            validate="primus.megatron.validate:validate",
            hf="primus.megatron.hf:INTEROP",
            planner="primus.megatron.planner_profile:PROFILE",
            native="primus.megatron.native:FORMAT",
            model_families=FAMILIES,
        )
    ]
