"""primus-torchtitan's plugin: the ``torchtitan`` backend (entry point ``torchtitan`` of group ``primus``)."""

from __future__ import annotations

from primus.core import hookimpl
from primus.core.contracts.engine import BackendSpec
from primus.torchtitan.validate import FAMILIES


@hookimpl
def primus_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="torchtitan",
            description="TorchTitan 0.2.2 Trainer: llama3/qwen3 models, FSDP2/HSDP/DDP, TP+SP, PP (1F1B, interleaved, "
            "zero-bubble), CP, activation checkpointing, torch.compile",
            engine="primus.torchtitan.engine:build",
            validate="primus.torchtitan.validate:validate",
            hf="primus.torchtitan.hf:INTEROP",
            planner="primus.torchtitan.planner_profile:PROFILE",
            native="primus.torchtitan.native:FORMAT",
            model_families=FAMILIES,
        )
    ]
