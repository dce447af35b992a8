"""Megatron-Core's facts for Primus's planner (:mod:`primus.core.planner.engine_profile`), named by the backend's spec
(``BackendSpec(planner="primus.megatron.planner_profile:PROFILE")``). Imports primus.core only: no torch, no engine.
"""

from __future__ import annotations

from primus.core.planner.engine_profile import EngineProfile

# core's linear roles (primus.core.kernels.linears) megatron runs as one GEMM, by its submodule name
GEMM_GROUPS = {"linear_qkv": ("q", "k", "v"), "linear_fc1": ("gate", "up")}


def dp_modes(tp: int, pp: int, dp: int) -> list[str]:
    """DDP; with more than one replica also DDP + the distributed optimizer (ZeRO-1: ``parallel.dp_shard > 1``, the
    default) and FSDP2 (``parallel.fsdp: true``: parameters, gradients and optimizer state sharded). Megatron's own
    FSDP is not offered (validate.py refuses backend.extra.fsdp); the backend's validation refuses the FSDP2 layouts
    it cannot checkpoint (odd dp, rows that do not split evenly)."""
    return ["ddp", "ddp_distopt", "fsdp"] if dp > 1 else ["ddp"]


def first_layers(layers_per_stage: int) -> range:
    """``recompute_method: block``: full recompute of the first N layers of each stage, any N."""
    return range(1, layers_per_stage)


PROFILE = EngineProfile(
    name="megatron",
    dp_modes=dp_modes,
    distributed_optimizer=True,
    recompute=("none", "selective", "full"),
    partial_recompute=first_layers,
    partial_recompute_method="block",
    # bf16 parameters; gradients accumulate in the fp32 main_grad buffer; the distributed optimizer (or Adam)
    # keeps an fp32 master copy besides m and v: 2 + 4 + 12 bytes per parameter
    weight_bytes=2,
    master_bytes=4,
    grad_bytes=4,
    grad_comm_bytes=2,  # the step-time model sends megatron's gradients in bf16
    # FSDP2 (parallel.fsdp: true): no main-grad buffer; the bf16 model's gradients, sharded, and one layer's unsharded
    # before the reduce-scatter
    fsdp_grad_bytes=2,
    fsdp_reduce_buffer_bytes=2,
    autocast=False,  # the model itself is bf16: no autocast copies
    activation_scale=1.0,
    # the per-parameter work of a step as measured (H200, bf16, one device, core's kernels, seq 4096 micro-batch 2:
    # benchmarks/results/step_kernels_h200.json, each kernel named there, the same on 1B and 3B): without apex,
    # torch's fused AdamW on the fp32 master copy (~58 bytes per parameter as timed), the gradient norm and clipping
    # (foreach, ~11), the bf16 gradients added into the fp32 main-grad buffer (~53), the copy of the master weights
    # to bf16 (~13) and the buffer's zeroing (~4): 139 on both
    optimizer_bytes_per_param=139,
    # selective recomputes only core attention, and with flash/cuDNN attention (all our providers) that saves
    # nothing measurable: H200, memory_validation.json (2026-11-29, llama3.2-1b s4096 mbs2): 31.5 GiB peak with and
    # without
    selective_kept=1.0,
    # the fused loss replaces the output layer + loss of the last stage's forward (under PP too) and sees CP's
    # labels there: only TP (and an FP8 head) keep megatron's own, which is core's rule for every engine, and
    # multi-token prediction, whose depths' losses megatron computes inside the same post-process
    fused_loss=True,
    # linear_qkv and linear_fc1 (gate and up) are one GEMM each (primus.megatron.fp8.linear_shapes)
    gemm_groups=GEMM_GROUPS,
    fused_loss_refused={
        "mtp": "multi-token prediction's depths run megatron's output layer and loss inside its post-process"
    },
)
