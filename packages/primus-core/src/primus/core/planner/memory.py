"""Per-device memory of one training layout, by category, from the engine's profile.

Bytes per parameter of the most loaded pipeline stage (P = its parameters after TP/PP division,
n = the data-parallel degree; bf16 compute, Adam), read from the engine's profile
(:class:`~primus.core.planner.engine_profile.EngineProfile`: w = ``weight_bytes``, g = ``grad_bytes``, m = ``master_bytes``;
fp32 runs: w = 4, m = 0). The two in-tree engines' profiles, as examples:

=========================== ========= ============= ===========================================
layout                      weights   gradients     optimizer (master + Adam m, v)
=========================== ========= ============= ===========================================
DDP                         w         g             m + 8
DDP + dist. optim.          w         g             (m + 8) / n  (where the engine has one)
FSDP                        w / n     g / n         (m + 8) / n  (+ two gathered layers and the
                                                                 engine's reduce-scatter buffer)
Megatron (w, g, m)          2 (bf16)  4 (main_grad) 4 + 8
TorchTitan (w, g, m)        4 (fp32)  4             0 + 8        (FSDP2: one fp32 reduce-scatter
                                                                 buffer; no distributed optimizer)
=========================== ========= ============= ===========================================

Activations of one layer for one micro-batch (s tokens / cp, b samples, a bytes per element; flash
attention, so no s×s scores): a·s·b·(4d / t_sp + (h·c + 2·kv·c + h·c + 3f) / t) — the layer input,
the two norm outputs and the residual (sharded by TP only with sequence parallel), then q, k, v, the
attention output and the SwiGLU gate, up and product (sharded by TP). Recompute keeps less:
selective keeps the share the engine's profile gives (``selective_kept``, measured per engine); full
keeps only the layer input, plus one layer's working set while it recomputes; partial applies full
to some layers. Pipelines hold min(pp, micro-batches) micro-batches on the first stage, times
Megatron's interleaving penalty 1 + (pp − 1)/(pp · vpp). The last stage also holds the logits:
s·b·V/t elements at a (logits) + 4 (fp32 loss) + 4 (their gradient) bytes, or with a fused linear +
cross-entropy (where the engine's profile says it uses one) one chunk of them plus the output weight's and hidden
states' gradients. Multi-token prediction (``model.mtp``, D depths, on the last stage): each depth adds a block (its
parameters and activations), its eh_proj input (2d) and a head's logits again (the fp32 loss copy of every head is
held until the backward, 4 more bytes a logit a depth; megatron keeps its own loss there, see
``EngineProfile.fused_loss_refused``); measured within 3% on an H100 (benchmarks/README.md, 2026-12-07). An
engine whose profile trains fp32 weights under autocast (``autocast``) without FSDP keeps its layer input and
residual in fp32 (4 bytes), the rest bf16.
With FP8 GEMMs (``fp8`` not off) the "fp8" part is what FP8 adds and takes off, and is mostly negative: an e4m3
copy of the FP8 layers' weights (tensorwise) replaces autocast's bf16 one, and their linears keep their inputs in
fewer bytes (:func:`fp8_bytes`).
Mixture of experts (``model.moe``): a device holds its ``E / ep`` routed experts of every MoE layer whole (expert
parallelism; expert tensor parallelism is not modelled) and the rest of the layer split by TP. Data-parallel sharding
(FSDP, the distributed optimizer) divides the experts over the expert-data-parallel group, tp · dp · cp / ep ranks,
so a sharded expert byte is 1 / (tp · dp · cp) per device, as a dense one. An MoE layer keeps the activations of the
(k + shared) experts each token runs (3 · expert width each, as the dense SwiGLU), its tokens permuted before and
after the experts (2 · k · d) and the router's fp32 logits (E).
Framework memory: outside the allocator the CUDA/HIP context and, with more than one rank, NCCL/RCCL
buffers ("context"); inside it GEMM workspaces plus allocator fragmentation ("overhead"). All constants:
:mod:`primus.core.planner.calibration` and the engines' profiles; measured against real runs by
``benchmarks/memory_validation.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from primus.core.config.deepseek import attention_activation_elements
from primus.core.config.schema import LoRAConfig, ModelConfig
from primus.core.kernels.fp8_recipe import FP8_RULE_TOKENS, call_tokens, fp8_blocks, fp8_linear_pays
from primus.core.kernels.linears import RankLinear, attention_linears, fused, mlp_linears, shared_expert_width
from primus.core.planner import calibration as cal
from primus.core.planner.calibration import GIB
from primus.core.planner.engine_profile import (
    ADAM_BYTES,
    NO_GROUPS,
    EngineProfile,
    GemmGroups,
    fused_loss_refusal,
    profile_of,
)
from primus.core.planner.modelmath import count_params, expert_params, lora_params

# parts of the breakdown that live outside the framework's caching allocator (torch.cuda.max_memory_reserved
# does not see them); the rest is what the allocator holds at the peak
OUTSIDE_ALLOCATOR = ("context",)


@dataclass(frozen=True)
class Layout:
    engine: str  # the backend's name
    dp_mode: str  # "ddp" | "ddp_distopt" | "fsdp"
    dp: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    recompute: str = "none"  # "none" | "selective" | "full" | "partial"
    recompute_layers: int = 0  # partial: layers per stage recomputed in full
    micro_batch: int = 1
    micro_batches: int = 1  # per step, per pipeline (gradient accumulation)
    # the engine's facts; None: those of the installed backend called ``engine`` (profile.profile_of)
    profile: EngineProfile | None = field(default=None, compare=False, repr=False)
    ep: int = 1  # expert parallelism (model.moe): each device holds E / ep routed experts, within dp · cp

    @property
    def engine_profile(self) -> EngineProfile:
        return self.profile if self.profile is not None else profile_of(self.engine)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    def describe(self) -> str:
        dp = {"ddp": "DDP", "ddp_distopt": "DDP+distopt", "fsdp": "FSDP"}[self.dp_mode]
        parts = [f"{dp} {self.dp}"]
        if self.tp > 1:
            parts.append(f"TP {self.tp}+SP")
        if self.pp > 1:
            parts.append(f"PP {self.pp}" + (f" VPP {self.vpp}" if self.vpp > 1 else ""))
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.ep > 1:
            parts.append(f"EP {self.ep}")
        names = {"none": "no recompute", "selective": "selective recompute", "full": "full recompute"}
        parts.append(names.get(self.recompute, f"full recompute of {self.recompute_layers} layers/stage"))
        return ", ".join(parts)


@dataclass
class MemoryBreakdown:
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def allocator(self) -> float:
        """What torch.cuda.max_memory_reserved should show at the peak (context and NCCL buffers left out)."""
        return self.total - sum(self.parts.get(k, 0.0) for k in OUTSIDE_ALLOCATOR)

    @property
    def allocated(self) -> float:
        """What torch.cuda.max_memory_allocated should show: the allocator's share without fragmentation."""
        return self.allocator - self.parts.get("fragmentation", 0.0)

    def gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.parts.items()}


def layers_per_stage(model: ModelConfig, layout: Layout) -> int:
    return math.ceil(model.num_layers / layout.pp)


def routed_expert_params(model: ModelConfig) -> int:
    """The routed experts' parameters of one MoE layer (0 for a dense model): E SwiGLU MLPs of the expert width (and
    their biases, GPT-OSS's)."""
    e = model.moe
    return 0 if e is None else e.num_experts * expert_params(model)


def layer_mean(model: ModelConfig, dense: float, moe: float) -> float:
    """A per-layer quantity averaged over the model's layers: ``dense`` in a dense layer, ``moe`` in an MoE one."""
    n = count_params(model).moe_layers
    return ((model.num_layers - n) * dense + n * moe) / model.num_layers


def mean_layer_params(model: ModelConfig, tp: int, expert_split: int) -> float:
    """One layer's parameters on a device, averaged over the model's dense and MoE layers: the routed experts split
    over ``expert_split`` devices, the rest over ``tp``."""
    pc, experts = count_params(model), routed_expert_params(model)
    return layer_mean(model, pc.per_layer / tp, (pc.moe_layer - experts) / tp + experts / expert_split)


def stage_params(model: ModelConfig, layout: Layout, expert_split: int | None = None) -> tuple[float, float]:
    """Parameters on the most loaded stage after TP division, and one layer's. Routed experts are split over
    ``expert_split`` devices: by default ``layout.ep`` (what a device holds whole); ``layout.tp`` gives the count
    that data-parallel sharding divides by dp · cp (the experts' data-parallel group is tp · dp · cp / ep)."""
    pc = count_params(model)
    layer = mean_layer_params(model, layout.tp, layout.ep if expert_split is None else expert_split)
    emb = pc.embedding / layout.tp
    head = (pc.output_head or (pc.embedding if layout.pp > 1 else 0)) / layout.tp  # tied: a copy on the last stage
    body = layers_per_stage(model, layout) * layer
    split = layout.ep if expert_split is None else expert_split
    mtp_experts = pc.mtp_moe_blocks * routed_expert_params(model)
    mtp = (pc.mtp - mtp_experts) / layout.tp + mtp_experts / split  # multi-token prediction: on the last stage
    first = body + emb + (head + pc.final_norm + mtp if layout.pp == 1 else 0)
    last = body + head + pc.final_norm + mtp
    return max(first, last), layer


def mlp_elements(model: ModelConfig) -> float:
    """Elements per token an MLP keeps for its backward, averaged over the layers: a dense SwiGLU's gate, up and
    product (3f); an MoE layer's for each of the (k + shared) experts a token runs, its permuted input and output
    (2 · k · d) and the router's logits (E, fp32: counted twice)."""
    e, f = model.moe, model.ffn_hidden_size
    if e is None:
        return 3 * f
    moe = 3 * (e.experts_per_token + e.shared_experts) * e.expert_ffn_hidden_size
    moe += 2 * e.experts_per_token * model.hidden_size + 2 * e.num_experts
    return layer_mean(model, 3 * f, moe)


def lora_params_per_layer(model: ModelConfig, lora: LoRAConfig) -> float:
    """The adapters' parameters of one layer (``train.lora``), averaged over the layers
    (:func:`~primus.core.planner.modelmath.lora_params`)."""
    return lora_params(model, lora) / model.num_layers


def lora_activation_elements(model: ModelConfig, lora: LoRAConfig) -> float:
    """Elements per token the adapters of one layer keep for their backward, besides the layer's own: each adapter's
    ``A x`` (``rank``), and with dropout the dropped copy of its input (``in``; its mask, one byte an element, is
    counted as a quarter of a bf16 element's two). Averaged over the layers."""
    from primus.core.hf.lora import adapters

    per_input = 1.5 if lora.dropout > 0 else 0.0
    return sum(lora.rank + per_input * a.in_features for a in adapters(model, lora)) / model.num_layers


def activation_bytes_per_layer(
    model: ModelConfig,
    layout: Layout,
    seq_len: int,
    dtype_bytes: int,
    residual_bytes: int | None = None,
    lora: LoRAConfig | None = None,
) -> dict[str, float]:
    s, b, t = seq_len / layout.cp, layout.micro_batch, layout.tp
    d, h, kv, c = model.hidden_size, model.num_attention_heads, model.num_kv_heads, model.kv_channels
    r = residual_bytes or dtype_bytes
    t_sp = t if layout.sequence_parallel else 1
    layer_input = r * s * b * d / t_sp
    norms = dtype_bytes * s * b * 2 * d / t_sp
    attention = 2 * h * c + 2 * kv * c
    if model.mla is not None:  # multi-head latent attention's q/k/v widths and latents (primus.core.config.deepseek)
        attention = attention_activation_elements(model)
    sharded = dtype_bytes * s * b * (attention + mlp_elements(model)) / t
    full = 2 * layer_input + norms + sharded  # the layer input and the residual, both norm outputs, the rest
    if lora is not None:  # each rank holds the adapters whole (not divided by TP)
        full += dtype_bytes * s * b * lora_activation_elements(model, lora)
    selective = full * layout.engine_profile.selective_kept
    return {"none": full, "selective": selective, "full": layer_input, "working": full}


def in_flight_micro_batches(layout: Layout) -> float:
    if layout.pp == 1:
        return 1.0
    inflight = min(layout.pp, layout.micro_batches)
    if layout.vpp > 1:
        inflight *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    return inflight


def fp8_layers(model: ModelConfig, fp8: str, bf16_first: int = 0, bf16_last: int = 0) -> int:
    """Layers whose GEMMs run in FP8 (the recipe keeps ``bf16_first`` / ``bf16_last`` layers in bf16)."""
    return 0 if fp8 == "off" else len(fp8_blocks(model.num_layers, bf16_first, bf16_last))


def fp8_bytes(model: ModelConfig, layout: Layout, seq_len: int, kernels: KernelTerms, autocast: bool) -> float:
    """What FP8 GEMMs change in the peak, per device (negative: they save): per FP8 layer parameter, the
    recipe's weight copy less autocast's bf16 one where the engine makes it (``autocast``); per element of the
    FP8 linears' inputs kept for the backward (the layers not recomputed), the bytes FP8 saves on them."""
    share = kernels.layout_fp8_share(model, layout, seq_len)
    nl = layers_per_stage(model, layout)
    _, layer = stage_params(model, layout)
    copy = cal.FP8_WEIGHT_COPY_BYTES[kernels.fp8] - (cal.AUTOCAST_WEIGHT_COPY_BYTES if autocast else 0)
    t_sp = layout.tp if layout.sequence_parallel else 1
    d, f = model.hidden_size, model.ffn_hidden_size
    # per layer: the two norm outputs (sequence-sharded with SP), the attention output and the SwiGLU product
    elements = seq_len / layout.cp * layout.micro_batch * (2 * d / t_sp + (d + f) / layout.tp)
    kept = {"none": nl, "selective": nl * layout.engine_profile.selective_kept, "full": 0}
    kept_layers = kept.get(layout.recompute, nl - layout.recompute_layers)  # partial: the layers not recomputed
    saved = cal.FP8_INPUT_BYTES_SAVED["compiled" if kernels.compiled else "eager"][kernels.fp8]
    return share * (copy * nl * layer - saved * elements * kept_layers * in_flight_micro_batches(layout))


@dataclass(frozen=True)
class KernelTerms:
    """What the run's kernels change in the memory and step-time models: ``fp8`` (kernels.fp8: off |
    tensorwise | rowwise) in ``fp8_layers`` of the model's layers (None: all, see :func:`fp8_layers`), and
    ``fused_loss``: the cross-entropy provider fuses the output projection (counted where the engine uses it, not
    with ``fp8_head``, an FP8 output projection). ``primus.core.planner.strategies.kernel_terms`` reads them from a config."""

    fp8: str = "off"
    fp8_layers: int | None = None
    fused_loss: bool = False
    fp8_head: bool = False
    # torch.compile (train.compile): it fuses the memory-bound work between the GEMMs (perf.layer_seconds_per_token),
    # and its partitioner, not the FP8 linear, picks what FP8 layers save
    compiled: bool = False
    # kernels.fp8_recipe.linears: "auto" leaves in bf16 the linears core's measured rule says FP8 would slow
    # (kernels.fp8_recipe.fp8_linear_pays); "all" (what the calibration runs had) every one
    fp8_linears: str = "all"
    # an MoE model's routed experts on FP8 grouped GEMMs (kernels.fp8_recipe.experts; see strategies.kernel_terms)
    fp8_experts: bool = False
    # the norms and SwiGLU on a provider's fused kernels (kernels.rms_norm / swiglu not core's torch ones): they take
    # a share of the memory-bound work off (the engine's EngineProfile.fused_kernels_kept; perf.step_time)
    fused_elementwise: bool = False

    def fp8_share(
        self, model: ModelConfig, tp: int = 1, ep: int = 1, tokens: int | None = None, groups: GemmGroups = NO_GROUPS
    ) -> float:
        """The fraction of a layer's parameters on a device (``tp``, experts over ``ep``) whose GEMMs run in FP8: the
        recipe's FP8 layers, and in them the linears :meth:`linear_share` counts (at ``tokens`` a micro-batch, the
        engine's ``groups``)."""
        if self.fp8 == "off":
            return 0.0
        n = model.num_layers if self.fp8_layers is None else self.fp8_layers
        return min(n / model.num_layers, 1.0) * self.linear_share(model, tp, ep, tokens, groups)

    def layout_fp8_share(self, model: ModelConfig, layout: Layout, seq_len: int) -> float:
        """:meth:`fp8_share` on one device of ``layout``: its TP and EP, a micro-batch's tokens a call, its engine's
        GEMM groups."""
        tokens = call_tokens(layout.micro_batch, seq_len, layout.cp)
        return self.fp8_share(model, layout.tp, layout.ep, tokens, layout.engine_profile.gemm_groups)

    def linear_share(
        self, model: ModelConfig, tp: int, ep: int = 1, tokens: int | None = None, groups: GemmGroups = NO_GROUPS
    ) -> float:
        """In an FP8 layer, the share of a device's layer parameters in FP8 linears: the dense linears (attention,
        a dense or shared-expert MLP; ``groups``: those the engine runs as one GEMM,
        :attr:`EngineProfile.gemm_groups <primus.core.planner.engine_profile.EngineProfile>`) whose per-rank weight
        ``fp8_linears`` puts in FP8 at ``tokens`` a micro-batch (None: the rule's own; compiled: every one), and the
        routed experts where ``fp8_experts`` says so. Linears a TP run keeps whole stay bf16 (both engines)."""
        at = FP8_RULE_TOKENS if tokens is None else tokens
        every = self.fp8_linears == "all" or self.compiled

        def weights(linears: dict[str, RankLinear], fp8_only: bool = False) -> float:
            return sum(
                i * o
                for i, o, split in fused(linears, groups).values()
                if not fp8_only
                or ((tp == 1 or split != "whole") and (every or fp8_linear_pays(i, o, compiled=False, tokens=at)))
            )

        attention = attention_linears(model, tp)
        dense = attention | mlp_linears(model, model.ffn_hidden_size, tp)
        if model.moe is None:
            return weights(dense, True) / weights(dense)
        moe_dense = attention | mlp_linears(model, shared_expert_width(model), tp)
        routed = routed_expert_params(model) / ep
        fp8 = layer_mean(model, weights(dense, True), weights(moe_dense, True) + routed * self.fp8_experts)
        return fp8 / layer_mean(model, weights(dense), weights(moe_dense) + routed)


PLAIN_KERNELS = KernelTerms()  # bf16 GEMMs, the logits materialised


def estimate(
    model: ModelConfig,
    layout: Layout,
    seq_len: int,
    precision: str = "bf16",
    kernels: KernelTerms = PLAIN_KERNELS,
    lora: LoRAConfig | None = None,
) -> MemoryBreakdown:
    """Per-device peak memory of ``layout`` with the kernels' FP8 weight copies and fused loss (``kernels``).

    With ``lora`` (``train.lora``) the base weights are frozen: held at the compute dtype (``precision``: 2 bytes in
    a bf16 run, whatever the engine's weight bytes otherwise), with no gradients and no optimizer state. The
    adapters (:func:`lora_params_per_layer` each layer of the stage, whole on every TP rank) train in fp32: 4 bytes
    of weights, 4 of gradients and Adam's 8 each, sharded as the engine shards its own; their activations come on
    top of the layer's (:func:`lora_activation_elements`)."""
    a = 4 if precision == "fp32" else 2
    engine = layout.engine_profile
    layout = replace(layout, profile=engine)  # looked up once
    params, layer = stage_params(model, layout)
    spread, _ = stage_params(model, layout, layout.tp)  # what data-parallel sharding divides by dp × cp
    n = layout.dp * layout.cp  # optimizer and FSDP state are sharded over dp × cp
    mixed = precision != "fp32"
    w, g = (engine.weight_bytes if mixed else 4), engine.grad_bytes
    if layout.dp_mode == "fsdp" and mixed and engine.fsdp_grad_bytes is not None:
        g = engine.fsdp_grad_bytes
    o = (engine.master_bytes if mixed else 0) + ADAM_BYTES
    shard_w = shard_g = layout.dp_mode == "fsdp"
    shard_o = layout.dp_mode == "fsdp" or (layout.dp_mode == "ddp_distopt" and engine.distributed_optimizer)
    parts = {
        "weights": spread * w / n if shard_w else params * w,
        "gradients": spread * g / n if shard_g else params * g,
        "optimizer": spread * o / n if shard_o else params * o,
    }
    if lora is not None:  # the base frozen at the compute dtype; the adapters fp32 with gradients and Adam's state
        adapters = layers_per_stage(model, layout) * lora_params_per_layer(model, lora)
        parts = {
            "weights": (spread * a / n if shard_w else params * a) + (adapters * 4 / n if shard_w else adapters * 4),
            "gradients": adapters * 4 / n if shard_g else adapters * 4,
            "optimizer": adapters * ADAM_BYTES / n if shard_o else adapters * ADAM_BYTES,
        }
    buffers = 0.0
    if layout.dp_mode == "fsdp" and n > 1:  # two gathered layers, and the engine's reduce-scatter buffer
        buffers = 2 * layer * a + layer * engine.fsdp_reduce_buffer_bytes
    autocast = engine.autocast and mixed and not (layout.dp_mode == "fsdp" and n > 1)
    if lora is not None:  # the engine holds the frozen base at the compute dtype: no fp32 weights under autocast
        autocast = False
    residual = cal.AUTOCAST_RESIDUAL_BYTES if autocast else a
    per_layer = activation_bytes_per_layer(model, layout, seq_len, a, residual, lora)
    nl = layers_per_stage(model, layout)  # all virtual chunks of the stage
    if layout.recompute == "partial":
        kept = layout.recompute_layers * per_layer["full"] + (nl - layout.recompute_layers) * per_layer["none"]
    else:
        kept = nl * per_layer[layout.recompute]
    if layout.recompute in ("full", "partial"):
        kept += per_layer["working"]
    s = seq_len / layout.cp
    depths = model.mtp.layers if model.mtp is not None else 0
    # a multi-token-prediction depth (last stage, one micro-batch in flight there): one more block's activations and
    # its eh_proj input (the two normed hidden states side by side)
    mtp = depths * (
        per_layer[layout.recompute if layout.recompute != "partial" else "none"]
        + a * s * 2 * model.hidden_size * layout.micro_batch
    )
    parts["activations"] = (kept * in_flight_micro_batches(layout) + mtp) * engine.activation_scale
    heads = 1 + depths  # each depth's logits again, through the shared output head
    # where the engine uses it (the rule the backends apply)
    if kernels.fused_loss and not fused_loss_refusal(
        engine, tp=layout.tp, pp=layout.pp, cp=layout.cp, fp8_head=kernels.fp8_head, mtp=depths > 0
    ):
        # one chunk of logits (no more than all of them), the output weight's gradient and the hidden states'
        # (made in the forward)
        parts["logits"] = (
            min(cal.FUSED_LOSS_CHUNK_BYTES, a * s * layout.micro_batch * model.vocab_size)
            + a * model.vocab_size * model.hidden_size
            + heads * a * s * layout.micro_batch * model.hidden_size
        )
    else:
        per_logit = a + cal.LOGITS_EXTRA_BYTES + (heads - 1) * cal.LOSS_COPY_BYTES
        parts["logits"] = s * layout.micro_batch * model.vocab_size / layout.tp * per_logit
    parts["buffers"] = buffers
    if kernels.fp8 != "off":
        parts["fp8"] = fp8_bytes(model, layout, seq_len, kernels, autocast)
    parts["workspace"] = cal.WORKSPACE_BYTES
    parts["fragmentation"] = cal.FRAGMENTATION * sum(parts.values())
    parts["context"] = cal.CONTEXT_BYTES + (cal.COMM_BUFFER_BYTES if layout.world > 1 else 0.0)
    return MemoryBreakdown(parts)
