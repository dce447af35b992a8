"""Every constant the planner's memory and step-time models are calibrated with, named, in one place.

Where a number was measured, the line says where (``benchmarks/results/h200_baseline.md``: one H200,
torch 2.11, 2026-11-29; ``benchmarks/results/memory_validation.json``: predicted vs measured peak memory
from ``benchmarks/memory_validation.py``; ``benchmarks/results/gpu_suite.json``: the GPU suite, one H100,
2026-12-07). Where it was not, the line says so. To recalibrate, change the number here and re-run
``benchmarks/memory_validation.py`` (memory) or compare ``primus plan``'s tokens/s with a measured run (time);
``tests/test_planner.py`` pins the behaviour these numbers produce, ``tests/test_planner_speed_calibration.py`` holds
the step time within 10% of every Primus training row of the suite (its table: docs/performance.md).
"""

from __future__ import annotations

GIB = 2**30

# ------------------------------------------------------------------------------------------------ memory
# Outside the framework's caching allocator (not in torch.cuda.max_memory_reserved): the CUDA/HIP context
# with its loaded kernels (torch 2.x lazy loading keeps it near 0.5-1 GiB on H100/H200) ...
CONTEXT_BYTES = 1.0 * GIB
# ... and NCCL/RCCL communicator buffers, only when there is another rank to talk to.
COMM_BUFFER_BYTES = 1.0 * GIB
# Inside the allocator: cuBLAS/cuDNN/hipBLASLt workspaces and small persistent buffers.
WORKSPACE_BYTES = 0.5 * GIB
# Allocator fragmentation: reserved − allocated at the peak, as a fraction of what the model counts.
FRAGMENTATION = 0.05
# Bytes per logit besides the logits themselves: the fp32 copy the loss works on and its gradient.
LOGITS_EXTRA_BYTES = 8
# Of them, the fp32 copy a loss keeps for its backward: held once per output head in use (multi-token prediction's
# depths run the head again), the rest (the gradient) one head at a time.
LOSS_COPY_BYTES = 4
# A fused linear + cross-entropy (primus-turbo) holds one chunk of logits at a time (its CHUNK_BUDGET_BYTES).
FUSED_LOSS_CHUNK_BYTES = 256 * 2**20
# What is particular to an engine (its state bytes per parameter, the share of activations its selective recompute
# keeps, a multiplier on the activation formula) is in its planner profile (primus.core.planner.engine_profile), each
# number there with where it was measured: primus.megatron.planner_profile, primus.torchtitan.planner_profile.
#
# An engine that trains fp32 weights under torch.autocast (profile.autocast; TorchTitan without FSDP): the residual
# stream (layer input and the attention block's output sum, both saved for the norms' backward) stays fp32; the
# norm outputs are saved as the bf16 copies autocast makes for the next GEMM.
AUTOCAST_RESIDUAL_BYTES = 4
# Such an engine (TorchTitan without FSDP): torch.autocast keeps a bf16 copy of each fp32 weight from the forward
# to the backward.
# The bf16 fits above absorb it (its 2 bytes per parameter are in no other term); FP8 layers run with autocast off
# and do not make it, which is what FP8 takes off (memory.fp8_bytes). Measured on the H200 (fp8_training.json,
# eager, 3B micro-batch 2): FP8 rowwise, which keeps the weights themselves, peaked 4.2 GiB below bf16; 2 bytes
# of its 2.8 G block parameters are 5.2 GiB.
AUTOCAST_WEIGHT_COPY_BYTES = 2
# FP8 (kernels.fp8 != off): the weight copy kept from forward to backward, per FP8 layer parameter: e4m3
# (tensorwise); rowwise re-quantizes the weight in the backward and keeps the weight itself. Per-tensor / per-row
# scales are a few bytes per tensor and left out.
FP8_WEIGHT_COPY_BYTES = {"tensorwise": 1, "rowwise": 0}
# FP8: bytes fewer per element of each FP8 linear's input (per token and layer: the two norm outputs, the
# attention output, the SwiGLU product) kept for the backward. Eager: both recipes keep the input in e4m3 (2 → 1
# byte; rowwise its transposed copy scaled per column, made in the forward's quantization pass). Measured on the
# H200 (fp8_training.json, eager, 3B micro-batch 2) when rowwise still kept the bf16 input: tensorwise 3.2 GiB
# below rowwise, against 3.7 GiB for 1 byte.
# Compiled (torch.compile's partitioner picks what is saved, in either recipe): FP8 3B peaked 12.0 (micro-batch 2)
# and 15.9 GiB (4) below bf16 (fp8_training_compiled_primus.json, fp8_training_3b_mbs4_gb8.json), 3.85 GiB per
# sample apart, against 1.86 GiB per sample for 1 byte: 2.
FP8_INPUT_BYTES_SAVED = {"eager": {"tensorwise": 1, "rowwise": 1}, "compiled": {"tensorwise": 2, "rowwise": 2}}

# A run is refused before it starts when the estimate exceeds the device's memory by more than this (the
# error benchmarks/memory_validation.py holds the model to), so a layout the model over-estimates still runs.
FIT_TOLERANCE = 0.10
# The planner recommends a layout only when its estimate stays this far below the usable memory (``primus plan
# --headroom``): the same ±10% the model is held to, so a layout the model under-estimates by that much still fits.
HEADROOM = FIT_TOLERANCE

# ------------------------------------------------------------------------------------------------ step time
# Achieved fraction of the dense bf16 peak in large training GEMMs, per device. H200: median of the eight
# bf16 GEMMs in h200_baseline.md (783, 693, 674, 691, 758, 656, 658, 696 TFLOP/s of 989) = 0.70. H100 shares
# the chip; the others are not measured here (set from public vendor GEMM results, to be replaced).
GEMM_FRACTION = {
    "H100": 0.70,
    "H200": 0.70,
    "B200": 0.65,
    "A100": 0.75,
    "MI300X": 0.55,
    "MI325X": 0.55,
    "MI355X": 0.50,
    "CPU": 0.70,
}
# Achieved fraction of the bf16 peak in causal attention forward + backward, counting causal FLOPs (half
# of the full s×s product). H200: cuDNN SDPA 396 (b4 s2048), 517 (s8192), 548 (GQA s8192) TFLOP/s of 989 →
# 0.45 at the sequence lengths trained most. Others: not measured here.
ATTENTION_FRACTION = {
    "H100": 0.45,
    "H200": 0.45,
    "B200": 0.40,
    "A100": 0.50,
    "MI300X": 0.35,
    "MI325X": 0.35,
    "MI355X": 0.30,
    "CPU": 0.50,
}
# Memory-bound work per token and layer (norms, RoPE, SwiGLU, residual adds, casts, launch gaps), as passes of
# 2 bytes over the layer's d + f activation elements at HBM bandwidth. Fitted (with the loss and optimizer
# terms below in place) so that the model reproduces the three end-to-end TorchTitan eager runs of
# h200_baseline.md: 1B-like s4096 mbs2 49.8% MFU (model 50.2%), 3B-like 55.7% (54.4%), 1B-like s8192
# 53.2% (53.8%); tests/test_planner.py::test_step_time_reproduces_the_h200_baseline keeps them within 5%.
MEMORY_BOUND_PASSES = 60
# torch.compile (train.compile: true): the share of the memory-bound passes above left once it fuses the elementwise
# work between the GEMMs (compile is assumed to change that term only, and no activation memory). Fitted to H200 bf16
# runs, eager against compiled: benchmarks/README.md, "Calibration notes".
COMPILE_MEMORY_BOUND_KEPT = 0.6
# A provider's fused norm and SwiGLU kernels (KernelTerms.fused_elementwise; primus-turbo's Triton ones): the share
# of the memory-bound passes above left, the default of EngineProfile.fused_kernels_kept (an engine whose weights are
# bf16; one that trains fp32 weights under autocast gives its own). Fitted to Primus-Megatron + turbo on an H100
# (benchmarks/results/gpu_suite.json: dense/1b-4096/mg_turbo, fp8_dense/megatron/*; mg_core, core's torch kernels,
# keeps all 60): 0.5. The H200 profile of such a run (benchmarks/README.md, megatron's multi-tensor fallbacks: GEMM
# 61%, attention 16%, optimizer 9%, elementwise 7%) leaves about a third of the eager passes' time to the rest.
FUSED_KERNELS_MEMORY_BOUND_KEPT = 0.5
# The rate (GB/s) the step's memory-bound work runs at: the passes and bytes per parameter here and in the engines'
# profiles were fitted or read on the H200 at its datasheet 4,800 GB/s. On the H100 the same runs' memory-bound
# work took 1.04x the H200's time, not the 1.43x its datasheet 3,350 GB/s gives (short, latency-bound kernels as much
# as bandwidth-bound ones): 4,600 fitted to benchmarks/results/gpu_suite.json (H100, 2026-12-07) with the H200
# runs of benchmarks/planner_vs_published.py ("ours") held. The plain engines at 1B ran 0.92x (TorchTitan, the suite's
# tt_plain against h200_baseline.md's compiled run) and 0.90x (megatron-core, against benchmarks/README.md's 42,847)
# the H200's tokens/s on the H100, where the datasheet ratio gave the model 0.85-0.88x. Other devices: their
# datasheet's (Device.hbm_gbps), not measured here.
STEP_HBM_GBPS = {"H200": 4800.0, "H100": 4600.0}
# The loss on the logits: bf16 logits read, fp32 softmax written and read back, gradient written (bytes/logit).
LOSS_BYTES_PER_LOGIT = 16
# Mixture of experts: the routed experts' grouped GEMMs run at the dense GEMM rate when each expert gets enough rows,
# and slower with fewer: the share of the dense rate is (tokens per expert / MOE_GEMM_FULL_RATE_TOKENS) **
# MOE_GEMM_RATE_EXPONENT, at most 1. Measured on the H200 (torch's grouped_mm, bf16; traced grouped-GEMM kernel time,
# benchmarks/results/moe_h200_profiled_engines.json, moe_h200_mixtral.json): Qwen3-30B-A3B's experts (768 wide) at
# 256 tokens each ran at 484 (Megatron) and 419 (TorchTitan) TFLOP/s, 0.70 and 0.60 of the dense 693 (0.65 here);
# Mixtral's (14,336 wide) at 1,024 tokens each at 721, the dense rate. Those runs' routing was uneven (the engines' own
# init on mock tokens: the worst layer's busiest expert took 14-16x the mean), so an even load may run faster.
MOE_GEMM_FULL_RATE_TOKENS = 1024
MOE_GEMM_RATE_EXPONENT = 0.31
# The per-parameter work of a step for the routed experts' parameters (bytes per parameter at HBM bandwidth): AdamW,
# the gradient norm and clipping, gradient accumulation, the copy of the updated weights to bf16 and the gradients'
# zeroing. A dense model's is its engine's optimizer_bytes_per_param (the rest of it fitted into the per-token terms
# with the engine's runs, where parameters and tokens grow together); an expert's parameters are mostly idle for a
# token, so their whole per-parameter work is counted. Measured on the H200 (benchmarks/results/step_kernels_h200.json,
# moe_h200_profiled_engines.json, the kernels named there): Megatron 108 (Qwen3-30B-A3B and Mixtral shapes alike),
# TorchTitan 107 (its fused AdamW, autocast's bf16 weight copies, zeroing).
EXPERT_STEP_BYTES_PER_PARAM = 108
# An MoE layer's token routing per token (EngineProfile.moe_dispatch_passes), as passes of 2 bytes over the k · d
# elements of a token's expert copies: the default is megatron's, fitted to the step-time growth from micro-batch 1 to 2
# on the H200 (Qwen3-30B-A3B shape, 6 layers: 159 -> 204 ms, moe_h200_stacked.json / moe_h200_mbs2.json): 60.
MOE_DISPATCH_PASSES = 60
# Fused AdamW per parameter and step: read fp32 param, grad, m, v; write param, m, v (and the bf16 copy). The default
# of EngineProfile.optimizer_bytes_per_param; each engine's profile gives what its optimizer step measured.
OPTIMIZER_BYTES_PER_PARAM = 30

# FP8 GEMMs: rate relative to the device's FP8 dense peak, as a fraction of what bf16 GEMMs reach of the
# bf16 peak. H200 (torch._scaled_mm, e4m3, h200_baseline.md): fp8/bf16 speed-up medians 1.98× tensorwise,
# 1.90× rowwise against a 2.0× peak ratio → 0.99 and 0.95.
FP8_RATE_VS_BF16 = {"tensorwise": 0.99, "rowwise": 0.95}
# The casts FP8 adds (memory-bound), per element of each GEMM input in forward and each output gradient in backward,
# and of each weight (twice: the transposed copy). Compiled (or fused, as Transformer Engine's): read bf16 + write
# e4m3, 3 bytes (not measured). Eager, each cast is several kernels (amax, scale, cast, the transposed copy): 14,
# fitted to the FP8 / bf16 pairs of benchmarks/results/gpu_suite.json (H100, Llama 8B's shapes: rowwise measured
# 1.08x on TorchTitan, 1.09x on megatron; 3 bytes gave 1.17x and 1.14x).
FP8_CAST_BYTES_PER_ELEMENT = {"eager": 14, "compiled": 3}

# Context parallelism (ring attention, primus-turbo's on both engines). The search tries cp > 1 only for sequences of
# at least CP_MIN_SEQ_LEN tokens, keeping at least CP_MIN_TOKENS_PER_RANK per rank: the model has no term for the
# lower efficiency of short attention blocks, measured nowhere here, so it would favour CP at lengths where
# recompute or TP is what published recipes use (8k and below).
CP_MIN_SEQ_LEN = 32768
CP_MIN_TOKENS_PER_RANK = 4096
# The fixed cost of one ring step (a K/V block's send / receive launched and waited on), per layer, micro-batch and
# pass: assumed from NCCL's point-to-point latency on NVLink / xGMI, not measured here.
CP_RING_STEP_S = 3e-5
