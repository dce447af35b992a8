"""TorchTitan 0.2.2's facts for Primus's planner (:mod:`primus.core.planner.engine_profile`), named by the backend's spec
(``BackendSpec(planner="primus.torchtitan.planner_profile:PROFILE")``). Imports primus.core only: no torch, no
engine.
"""

from __future__ import annotations

from primus.core.planner.engine_profile import EngineProfile


def dp_modes(tp: int, pp: int, dp: int) -> list[str]:
    """0.2.2: DDP only as the sole parallelism (no TP or PP beside it), FSDP2 otherwise; no distributed optimizer.
    One replica is FSDP2 of one shard."""
    return ["ddp", "fsdp"] if tp == pp == 1 and dp > 1 else ["fsdp"]


def every_kth_block(layers_per_stage: int) -> list[int]:
    """Selective per layer: checkpoint every k-th block (k = 4, 3, 2), ``layers_per_stage // k`` of each stage.
    The config has no field for it yet (``backend.extra.activation_checkpoint.selective_ac_option: k`` asks for it):
    as the planner writes a partial recompute (``parallel.recompute_layers``) this backend's validation refuses it, so
    neither ``primus plan`` nor ``parallel.strategy: auto`` recommends it; ``primus plan`` counts it among the layouts
    torchtitan refuses."""
    return [layers_per_stage // k for k in (4, 3, 2) if layers_per_stage // k]


PROFILE = EngineProfile(
    name="torchtitan",
    dp_modes=dp_modes,
    distributed_optimizer=False,
    recompute=("none", "selective", "full"),
    partial_recompute=every_kth_block,
    partial_recompute_method=None,
    # fp32 parameters (they are the master weights: no copy in the optimizer, which keeps Adam's m and v); FSDP2's
    # mixed precision gathers bf16 copies of them and reduce-scatters fp32 gradients through one fp32 buffer
    weight_bytes=4,
    master_bytes=0,
    grad_bytes=4,
    grad_comm_bytes=4,
    fsdp_reduce_buffer_bytes=4,
    # without FSDP (or with one shard) it trains the fp32 weights under torch.autocast
    autocast=True,
    activation_scale=1.0,
    # the optimizer step as measured (H200, bf16 autocast over fp32 weights, one device:
    # benchmarks/results/turbo_e2e_s7_{1b,3b}.json, tt_core's traced "optimizer" kernels: 50.6 ms of 367 for 3.6 G
    # parameters, 21.7 of 170 for 1.5 G): fused AdamW plus clipping's foreach norm and scaling, ~68 bytes per parameter
    optimizer_bytes_per_param=68,
    # its MoE token routing (index_put / gather / their backward, the router's softmax and top-k) per token: fitted to
    # the step-time growth from micro-batch 1 to 2 (H200, Qwen3-30B-A3B shape, 6 layers: 155 -> 224 ms,
    # moe_h200_grouped.json tt_core / moe_h200_mbs2.json tt_grouped), 3.3x megatron's (its routing kernels traced
    # 14.6 ms a step against megatron's 5.8, moe_h200_profiled_engines.json)
    moe_dispatch_passes=200,
    # primus-turbo's fused norm and SwiGLU take nothing measurable off its memory-bound work (the fp32 residual stream
    # and autocast's casts stay): eager TorchTitan + turbo on an H100 (benchmarks/results/gpu_suite.json:
    # fp8_dense/torchtitan/bf16, gemm_tuning/*, document_mask/causal) fit the full passes
    fused_kernels_kept=1.0,
    # the op-level policy (recompute all but the matmuls' outputs, every other one kept) freed 7.0 of ~10.2 GiB:
    # H200, memory_validation.json (2026-11-29, llama3.2-1b s4096 mbs2)
    selective_kept=0.32,
    fused_loss=True,
    fused_loss_refused={
        "pp": "pipeline schedules call the loss outside the last stage's forward",
        "cp": "context parallelism shards the labels inside torchtitan's train context",
    },
)
