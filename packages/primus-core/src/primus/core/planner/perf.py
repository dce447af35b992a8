"""Estimated step time of a layout: compute, pipeline bubble, and the communication left exposed.

- compute = micro-batches × the time of the slowest pipeline stage for one micro-batch, its tokens ÷ (tp · cp),
  ÷ 0.9^log2(tp). Per token and layer: GEMMs (6 × the layer's weights) at the device's achieved GEMM
  rate (the FP8 rate for FP8 layers, plus the casts FP8 adds), causal attention (6·h·c·s) at its achieved
  attention rate, and memory-bound work (norms, RoPE, SwiGLU, adds) as passes over d + f elements at the step's
  memory rate (``Device.step_hbm_gbps``; under torch.compile, ``train.compile``, the share ``COMPILE_MEMORY_BOUND_KEPT``
  of it: compile fuses that elementwise work, and is assumed to change nothing else; with a provider's fused norm and
  SwiGLU kernels, ``KernelTerms.fused_elementwise``, the engine's ``fused_kernels_kept`` of it); all times the
  recompute factor (none 1, selective 1.03, full 4/3 for one more forward, partial 1 + share/3). The last stage adds
  the output head GEMM and the loss, and per multi-token-prediction depth a block, its eh_proj and the head again;
  every device adds the optimizer step over its parameters. Rates and constants: :mod:`primus.core.planner.calibration`.
- pipeline bubble = compute × (pp − 1) / (micro-batches × vpp), plus a fixed 0.2 ms per hop.
- data-parallel traffic per device, ring collectives ((n − 1)/n of the payload per step of the ring):
  DDP all-reduce of gradients once per step = 2·G bytes of gradients; DDP + distributed optimizer
  (reduce-scatter gradients, all-gather parameters) the same volume; FSDP per micro-batch: parameter
  all-gather in forward and again in backward (reshard after forward) plus a gradient reduce-scatter.
  Gradients travel in the bytes the engine's profile gives (``grad_comm_bytes``: bf16 on Megatron, fp32 on
  TorchTitan, FSDP2's reduce dtype).
  DDP overlaps with the backward of the last micro-batch only (earlier ones accumulate without sync);
  FSDP with every micro-batch's compute. At best 90% (DDP) / 80% (FSDP, the first gather of each step
  is exposed) is hidden.
- TP: 4 collectives per layer per micro-batch (2 forward, 2 backward; 6 with full recompute) of the
  layer's activations, over intra-node links, not overlapped (no TE comm overlap assumed).
- PP: activations sent forward and gradients back per micro-batch and virtual stage, half hidden.
- CP (ring attention): each rank's K/V blocks passed around the ring per layer, micro-batch and pass, hidden behind
  the layer's attention compute where that is longer, plus a fixed cost per ring step (:func:`context_parallel_exchange`).
- Mixture of experts: a token's GEMMs are the layer's *active* weights (attention, router, its k + shared experts),
  the routed experts' at a share of the dense rate that grows with the tokens each expert gets
  (:func:`moe_gemm_fraction`); the routed experts' parameters each add their whole per-parameter step work
  (``EXPERT_STEP_BYTES_PER_PARAM``: optimizer, gradient accumulation, weight copies), and each token's routing
  (top-k, permute / unpermute) the engine's ``moe_dispatch_passes`` over its k · d copies; expert parallelism adds per MoE layer and
  micro-batch four all-to-alls (dispatch and combine, forward and backward; six with full recompute) of each
  token's k copies of d elements, (ep − 1)/ep of them leaving the device, over intra-node links unless
  tp · cp · ep spans nodes, not overlapped.
Ranks are placed TP innermost, then CP and DP, then PP (Megatron's order), so a group spans nodes when
the product of the sizes inside it exceeds the GPUs of a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from primus.core.config.deepseek import head_width
from primus.core.config.schema import LoRAConfig, ModelConfig
from primus.core.planner import calibration as cal
from primus.core.planner.hardware import Device
from primus.core.planner.memory import (
    PLAIN_KERNELS,
    KernelTerms,
    Layout,
    layer_mean,
    lora_params_per_layer,
    routed_expert_params,
    stage_params,
)
from primus.core.planner.modelmath import attended_keys, count_params, expert_params

# A TP split makes each GEMM narrower and puts collectives between them that stall the stream:
# the fraction of the unsplit rate kept per doubling of tp (0.9: TP 8 keeps 73%).
TP_EFFICIENCY = 0.9
# Fixed cost of one pipeline hop (send/recv launch, synchronisation) per micro-batch and virtual stage.
PP_HOP_S = 2e-4


@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    dp_comm: float
    tp_comm: float
    pp_comm: float
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (model.moe)
    cp_comm: float = 0.0  # context parallelism's K/V ring, the part the attention does not hide

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.dp_comm + self.tp_comm + self.pp_comm + self.ep_comm + self.cp_comm


def recompute_factor(layout: Layout, layers_per_stage: int) -> float:
    if layout.recompute == "full":
        return 4 / 3
    if layout.recompute == "partial":
        return 1 + layout.recompute_layers / layers_per_stage / 3
    return 1.03 if layout.recompute == "selective" else 1.0


def gemm_rate(dev: Device, fp8: str = "off") -> float:
    """Achieved FLOP/s of training GEMMs on ``dev``: bf16, or FP8 with the given scaling."""
    bf16 = dev.peak_flops * dev.gemm_fraction
    if fp8 == "off" or not dev.fp8_peak_flops:
        return bf16
    return dev.fp8_peak_flops * dev.gemm_fraction * cal.FP8_RATE_VS_BF16[fp8]


def active_layer_params(model: ModelConfig) -> tuple[float, float]:
    """The weights one token's GEMMs use in a layer, averaged over the layers: (everything but the routed experts, the
    routed experts it is sent to, k of them)."""
    pc = count_params(model)
    if model.moe is None:
        return float(pc.per_layer), 0.0
    e = model.moe
    routed = e.experts_per_token * expert_params(model)
    return layer_mean(model, pc.per_layer, pc.moe_layer_active - routed), layer_mean(model, 0.0, routed)


def moe_gemm_fraction(tokens_per_expert: float) -> float:
    """The share of the dense GEMM rate the routed experts' grouped GEMMs reach with this many rows per expert."""
    return min(1.0, (max(tokens_per_expert, 1.0) / cal.MOE_GEMM_FULL_RATE_TOKENS) ** cal.MOE_GEMM_RATE_EXPONENT)


def tokens_per_expert(model: ModelConfig, layout: Layout, seq_len: int) -> float:
    """Rows each routed expert's GEMM gets per micro-batch (0 without experts): a device's tokens, k copies each, over
    the experts, times ep (a device's E / ep experts take the tokens of the ep devices of its group)."""
    if model.moe is None:
        return 0.0
    tokens = layout.micro_batch * seq_len / (layout.tp * layout.cp)
    return tokens * model.moe.experts_per_token * layout.ep / model.moe.num_experts


def layer_seconds_per_token(
    model: ModelConfig,
    seq_len: int,
    dev: Device,
    fp8: str = "off",
    compiled: bool = False,
    expert_tokens: float = cal.MOE_GEMM_FULL_RATE_TOKENS,
    dispatch_passes: float = cal.MOE_DISPATCH_PASSES,
    kernels_kept: float = 1.0,
    lora: LoRAConfig | None = None,
) -> dict[str, float]:
    """One transformer layer, forward + backward, one token (no TP, no recompute), by kind of work; ``compiled``:
    under torch.compile, which fuses the memory-bound work (``calibration.COMPILE_MEMORY_BOUND_KEPT`` of it left);
    ``expert_tokens``: the rows each routed expert's GEMM gets (:func:`tokens_per_expert`); ``dispatch_passes``: the
    engine's token routing in an MoE layer (EngineProfile.moe_dispatch_passes); ``kernels_kept``: the share of the
    memory-bound work left where the norms and SwiGLU run on a provider's fused kernels
    (EngineProfile.fused_kernels_kept; 1: core's torch ones); ``lora``: ``train.lora``, the base weights frozen (their
    GEMMs forward and input gradient only, 4 FLOPs a weight and token) and the adapters trained (6 a parameter)."""
    d, f, h, kv, c = (
        model.hidden_size,
        model.ffn_hidden_size,
        model.num_attention_heads,
        model.num_kv_heads,
        model.kv_channels,
    )
    hbm = dev.step_hbm_gbps * 1e9
    # what torch.compile and the provider's fused kernels leave of the memory-bound work
    fused = (cal.COMPILE_MEMORY_BOUND_KEPT if compiled else 1.0) * kernels_kept
    dense, experts = active_layer_params(model)
    if model.moe is not None:  # the width of the elementwise work: the experts a token runs
        e = model.moe
        f = layer_mean(model, f, (e.experts_per_token + e.shared_experts) * e.expert_ffn_hidden_size)
    per_weight = 6 if lora is None else 4  # forward, input gradient, weight gradient (none for a frozen weight)
    adapters = 6 * lora_params_per_layer(model, lora) / gemm_rate(dev) if lora is not None else 0.0
    out = {
        "gemm": per_weight * dense / gemm_rate(dev, fp8)
        + per_weight * experts / (gemm_rate(dev, fp8) * moe_gemm_fraction(expert_tokens))
        + adapters,
        # ½ 12·h·c·s (s: the keys a query attends to, at most the window in a sliding layer)
        "attention": 6
        * h
        * head_width(model)
        * attended_keys(model, seq_len)
        / (dev.peak_flops * dev.attention_fraction),
        "memory_bound": cal.MEMORY_BOUND_PASSES * 2 * (d + f) / hbm * fused,
    }
    if model.moe is not None:  # routing each token's k copies to their experts and back, averaged over the layers
        out["routing"] = layer_mean(model, 0.0, dispatch_passes * 2 * model.moe.experts_per_token * d / hbm)
    if fp8 != "off" and dev.fp8_peak_flops:
        # forward GEMM inputs (qkv, o, gate/up, down) and backward output gradients, cast to e4m3
        elements = (2 * d + h * c + f) + ((h + 2 * kv) * c + 2 * d + 2 * f)
        out["fp8_casts"] = cal.FP8_CAST_BYTES_PER_ELEMENT["compiled" if compiled else "eager"] * elements / hbm
    return out


def step_time(
    model: ModelConfig,
    layout: Layout,
    seq_len: int,
    global_batch: int,
    dev: Device,
    gpus_per_node: int,
    kernels: KernelTerms = PLAIN_KERNELS,
    lora: LoRAConfig | None = None,
) -> StepTime:
    """The step time of ``layout``; ``lora`` (``train.lora``): the base weights frozen, so no weight gradients for
    them (:func:`layer_seconds_per_token`; the head's too), and the optimizer step and the gradients' data-parallel
    traffic cover the adapters alone (fp32), while FSDP still gathers the frozen weights."""
    lps = math.ceil(model.num_layers / layout.pp)
    m = layout.micro_batches
    hbm = dev.step_hbm_gbps * 1e9
    profile = layout.engine_profile
    rows, passes = tokens_per_expert(model, layout, seq_len), profile.moe_dispatch_passes
    kept = profile.fused_kernels_kept if kernels.fused_elementwise else 1.0
    terms = (kernels.compiled, rows, passes, kept, lora)
    bf16_layer = sum(layer_seconds_per_token(model, seq_len, dev, "off", *terms).values())
    fp8_layer = sum(layer_seconds_per_token(model, seq_len, dev, kernels.fp8, *terms).values())
    fp8_share = kernels.layout_fp8_share(model, layout, seq_len)
    layer_s = fp8_share * fp8_layer + (1 - fp8_share) * bf16_layer
    # the slowest pipeline stage sets the pace: the last one also runs the output head and the loss
    head_s = (6 if lora is None else 4) * model.vocab_size * model.hidden_size / gemm_rate(
        dev
    ) + cal.LOSS_BYTES_PER_LOGIT * model.vocab_size / hbm
    token_s = lps * layer_s * recompute_factor(layout, lps) + head_s
    if model.mtp is not None:  # each multi-token-prediction depth (last stage): a block, its eh_proj, the head again
        d = model.hidden_size
        token_s += model.mtp.layers * (bf16_layer + 6 * 2 * d * d / gemm_rate(dev) + head_s)
    tokens_per_micro_batch = layout.micro_batch * seq_len / (layout.tp * layout.cp)
    tp_slowdown = TP_EFFICIENCY ** math.log2(layout.tp)
    compute = m * tokens_per_micro_batch * token_s / tp_slowdown
    params, layer_params = stage_params(model, layout)
    fp8_weight_casts = 0.0
    # each micro-batch casts the stage's weights (and a transposed copy): a device's share of each layer's, its
    # E / ep routed experts included
    if kernels.fp8 != "off" and dev.fp8_peak_flops:
        cast = cal.FP8_CAST_BYTES_PER_ELEMENT["compiled" if kernels.compiled else "eager"]
        fp8_weight_casts = m * 2 * cast * lps * layer_params * fp8_share / hbm
    ep_comm = expert_all_to_all(model, layout, seq_len, dev, gpus_per_node)
    # the parameters the optimizer steps and whose gradients travel: under LoRA the adapters alone (fp32, whole on
    # every TP rank; the base and the experts frozen)
    trained = lps * lora_params_per_layer(model, lora) if lora is not None else params
    # the routed experts on this stage, whose whole per-parameter work counts (calibration.EXPERT_STEP_BYTES_PER_PARAM)
    experts = 0.0
    if model.moe is not None and lora is None:
        experts = lps * layer_mean(model, 0.0, routed_expert_params(model) / layout.ep)
    dense_bytes = layout.engine_profile.optimizer_bytes_per_param * (trained - experts)
    expert_bytes = cal.EXPERT_STEP_BYTES_PER_PARAM * experts
    if layout.dp_mode != "ddp":  # sharded: the dense weights over dp · cp, the E / ep experts over their own
        # data-parallel group (dp · cp / ep ranks: the experts differ across the ep ranks)
        dense_bytes /= layout.dp * layout.cp
        expert_bytes /= max(1.0, layout.dp * layout.cp / layout.ep)
    optimizer = (dense_bytes + expert_bytes) / hbm
    compute += fp8_weight_casts + optimizer
    bubble = compute * (layout.pp - 1) / (m * layout.vpp) + (2 * m * layout.vpp * PP_HOP_S if layout.pp > 1 else 0.0)

    n = layout.dp * layout.cp
    grad_bytes = layout.engine_profile.grad_comm_bytes
    ring = (n - 1) / n if n > 1 else 0.0
    dp_spans_nodes = layout.tp * layout.cp * layout.dp > gpus_per_node
    bw = (dev.inter_gbps if dp_spans_nodes else dev.intra_gbps) * 1e9
    if lora is not None:
        grad_bytes = 4  # the adapters' gradients are fp32
    if layout.dp_mode == "fsdp":  # the (frozen or trained) weights gathered twice, the trained ones' grads reduced
        volume = m * ring * (params * (2 + 2) + trained * grad_bytes)
        window, hidden = compute, 0.8
    else:
        volume = ring * trained * 2 * grad_bytes
        window, hidden = compute / m * 2 / 3, 0.9
    comm = volume / bw
    dp_exposed = max(comm - hidden * window, (1 - hidden) * comm) if comm else 0.0

    a = 2
    act = seq_len / layout.cp * layout.micro_batch * model.hidden_size * a
    tp_ring = 2 * (layout.tp - 1) / layout.tp
    n_coll = 6 if layout.recompute == "full" else 4
    tp_comm = n_coll * lps * m * tp_ring * act / (dev.intra_gbps * 1e9) if layout.tp > 1 else 0.0

    pp_spans_nodes = layout.world > gpus_per_node
    pp_bw = (dev.inter_gbps if pp_spans_nodes else dev.intra_gbps) * 1e9
    pp_comm = 0.5 * 2 * m * layout.vpp * act / layout.tp / pp_bw if layout.pp > 1 else 0.0
    cp_comm = context_parallel_exchange(model, layout, seq_len, dev, gpus_per_node)
    return StepTime(compute, bubble, dp_exposed, tp_comm, pp_comm, ep_comm, cp_comm)


def context_parallel_exchange(
    model: ModelConfig, layout: Layout, seq_len: int, dev: Device, gpus_per_node: int
) -> float:
    """Seconds per step of context parallelism's ring exchange left exposed (0 at cp 1): per layer and micro-batch,
    each pass (forward; backward: K/V again and dK/dV back; a recomputed forward) moves cp − 1 blocks of a rank's K and
    V (bf16, its TP share of the KV heads), overlapped with that layer's attention compute, plus a fixed cost per
    ring step (``calibration.CP_RING_STEP_S``)."""
    if layout.cp == 1:
        return 0.0
    lps = math.ceil(model.num_layers / layout.pp)
    kv_heads = max(model.num_kv_heads / layout.tp, 1.0)
    block = layout.micro_batch * seq_len / layout.cp * 2 * kv_heads * model.kv_channels * 2
    passes = 4 if layout.recompute == "full" else 3
    spans = layout.tp * layout.cp > gpus_per_node
    bw = (dev.inter_gbps if spans else dev.intra_gbps) * 1e9
    comm = passes * (layout.cp - 1) * block / bw
    tokens = layout.micro_batch * seq_len / (layout.tp * layout.cp)
    heads, c = model.num_attention_heads, head_width(model)
    attention = tokens * 6 * heads * c * seq_len / (dev.peak_flops * dev.attention_fraction)
    exposed = max(comm - attention, 0.0) + passes * (layout.cp - 1) * cal.CP_RING_STEP_S
    return lps * layout.micro_batches * exposed


def expert_all_to_all(model: ModelConfig, layout: Layout, seq_len: int, dev: Device, gpus_per_node: int) -> float:
    """Seconds per step a device spends in expert parallelism's all-to-alls (0 without experts or at ep 1)."""
    if model.moe is None or layout.ep == 1:
        return 0.0
    moe_layers = math.ceil(count_params(model).moe_layers / layout.pp)
    tokens = layout.micro_batch * seq_len / (layout.tp * layout.cp)  # a device's, sequence-parallel under TP
    payload = tokens * model.moe.experts_per_token * model.hidden_size * 2 * (layout.ep - 1) / layout.ep  # bf16
    n_coll = 6 if layout.recompute == "full" else 4
    spans = layout.tp * layout.cp * layout.ep > gpus_per_node
    bw = (dev.inter_gbps if spans else dev.intra_gbps) * 1e9
    return n_coll * moe_layers * layout.micro_batches * payload / bw
