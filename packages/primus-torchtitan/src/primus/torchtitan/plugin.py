"""primus-torchtitan's plugin: the ``torchtitan`` backend (entry point ``torchtitan`` of group ``primus``)."""

from __future__ import annotations

from primus.core import hookimpl
from primus.core.protocols import BackendSpec
from primus.torchtitan.validate import FAMILIES


@hookimpl
def primus_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="torchtitan",
            description="TorchTitan 0.2.2 Trainer: llama3/qwen3 models, FSDP2/HSDP/DDP, TP+SP, PP (1F1B, interleaved, "
            "zero-bubble), CP, activation checkpointing, torch.compile",
            run="primus.torchtitan.runner:run",
            validate="primus.torchtitan.validate:validate",
            hf="primus.torchtitan.hf:INTEROP",
            model_families=FAMILIES,
            features=frozenset(
                {
                    "fsdp",
                    "hsdp",
                    "ddp",
                    "tp",
                    "sp",
                    "pp",
                    "vpp",
                    "cp",
                    "recompute",
                    "compile",
                    "bf16",
                    "checkpoint",
                    "resume",
                    "kernels",
                    "profile",
                    "health",
                }
            ),
        )
    ]
