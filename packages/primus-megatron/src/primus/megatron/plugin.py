"""Registers the ``megatron`` backend with Primus (entry point ``megatron`` of group ``primus``)."""

from __future__ import annotations

from primus.core import hookimpl
from primus.core.protocols import BackendSpec

FEATURES = frozenset(
    {
        "ddp",
        "distributed_optimizer",
        "overlap_grad_reduce",
        "overlap_param_gather",
        "tp",
        "sequence_parallel",
        "pp",
        "vpp",
        "recompute",
        "checkpoint",
        "megatron_data",
        "profile",
        "health",
    }
)


@hookimpl
def primus_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="megatron",
            description="Megatron-Core 0.16.1: GPTModel with a kernel layer spec, DDP + distributed optimizer, TP/SP, "
            "PP 1F1B / interleaved, recompute, dist_checkpointing, profiling, health checks",
            run="primus.megatron.runner:run",
            validate="primus.megatron.validate:validate",
            hf="primus.megatron.hf:INTEROP",
            model_families=frozenset({"llama", "qwen2", "qwen3", "mistral"}),
            features=FEATURES,
        )
    ]
