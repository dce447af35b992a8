"""The process group a megatron run needs (megatron-core needs one even for a single process), and megatron's
parallel state on it (TP / PP / VPP / CP / DP groups, the model-parallel RNG seeds).

megatron-core is imported inside the functions: on a CPU, :func:`init_distributed` redirects megatron's CUDA calls
(:mod:`primus.megatron.cpu`) before anything imports the megatron modules that read the device.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from primus.core.launch.env import free_port
from primus.megatron import compat

# megatron warns once per process about every optional fused kernel it cannot find (TE, apex): expected on a
# local-spec build; kept out of the run log.
OPTIONAL_KERNEL_WARNINGS = ("Transformer Engine", "TransformerEngine", "Apex", "apex")


# Warned by every rank of a run about what megatron-core itself calls, nothing a user can change: torch's
# deprecated collectives in its distributed optimizer, and the .grad of a non-leaf tensor (its gradient buffers'
# views; on a CPU raised through primus.megatron.cpu's redirect); the torch APIs its checkpoint loader calls on a
# resume (ShardedTensor, DCP's load_state_dict); and the installed release's own (compat).
ENGINE_WARNINGS = (
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    "Please use DTensor instead and we are deprecating ShardedTensor",
    "`load_state_dict` is deprecated",
    *compat.ENGINE_WARNINGS,
)


_quieted: set[str] = set()  # the loggers given their filter (once per process)


def _not_said(text: str) -> Callable[[logging.LogRecord], bool]:
    return lambda record: not record.getMessage().startswith(text)


def quiet_optional_kernel_warnings() -> None:
    """Ignore megatron's missing-TE / apex warnings (installed before megatron is first imported),
    :data:`ENGINE_WARNINGS`, and the log lines megatron writes about its own calls (``compat.ENGINE_LOG_LINES``)."""
    for pattern in OPTIONAL_KERNEL_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{pattern}.*")
    for text in ENGINE_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(text))
    for name, text in compat.ENGINE_LOG_LINES.items():
        if name not in _quieted:
            logging.getLogger(name).addFilter(_not_said(text))
            _quieted.add(name)


def init_distributed(timeout: timedelta) -> tuple[int, int, str]:
    """Start the process group; returns (rank, world size, device type). A collective that hangs longer than
    ``timeout`` errors out. On a CPU, megatron's CUDA calls are redirected first (:mod:`primus.megatron.cpu`)."""
    quiet_optional_kernel_warnings()
    gpu = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if gpu:
        torch.cuda.set_device(local_rank)
    else:
        from primus.megatron.cpu import redirect_to_cpu

        redirect_to_cpu()
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
            dist.init_process_group("nccl" if gpu else "gloo", timeout=timeout)
        else:
            dist.init_process_group(
                "nccl" if gpu else "gloo",
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    return dist.get_rank(), dist.get_world_size(), "cuda" if gpu else "cpu"


def init_parallel(
    tp: int, pp: int, vpp: int, cp: int, optimizer_instances: int = 1, timeout_s: float | None = None, ep: int = 1
) -> None:
    """megatron's parallel state. ``optimizer_instances`` > 1: the distributed optimizer shards within groups of
    DP / instances ranks and is replicated across the instances (HSDP-like: dp_replicate × dp_shard).
    ``timeout_s``: the collective timeout of the groups megatron creates (it takes minutes)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        # experts whole on each rank (not split over tp): their tokens are already split over the ep ranks, and
        # megatron's expert-TP dispatch all-gathers uneven token counts, which gloo cannot
        expert_tensor_parallel_size=1,
        num_distributed_optimizer_instances=optimizer_instances,
        **({"distributed_timeout_minutes": timeout_s / 60} if timeout_s else {}),
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def teardown(*, failed: bool = False) -> None:
    """The end of a megatron process's run: parallel state, then the process group (after every rank is here; not
    when this rank ``failed``: the others may be inside a collective this rank will never join, and its error, raised
    next, is what stops the job)."""
    destroy_parallel()
    if dist.is_initialized():
        if not failed:
            dist.barrier()
        dist.destroy_process_group()


def seed(seed_: int) -> None:
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed_)


def stage(vp_stage: int | None) -> tuple[bool, bool]:
    """(is first pipeline stage, is last pipeline stage) for a model chunk."""
    from megatron.core import parallel_state

    return (
        parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
    )


def ranks() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "dp_size": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_rank(),
    }
