"""The Primus config schema: one typed model per section, every field with a default and a description.

Checks here are those that need only the config itself (shapes, ranges, cross-field rules). Checks
that need the installed plugins (backend and kernel names) or the world size live in
:mod:`primus.core.config.validate`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Auto = Literal["auto"]


#: ``train.seed``'s largest value: both engines seed torch's generators with it plus per-rank offsets (megatron adds
#: 2718 + its tensor / expert ranks, torchtitan its pipeline rank), which must stay below 2**64.
MAX_SEED = 2**32 - 1


class Section(BaseModel):
    # strict: a YAML string is not silently taken for a number; unknown keys are errors; no float is inf or nan
    # (`lr: .inf` would pass `gt=0` and train a step before failing).
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)


class RopeScaling(Section):
    type: Literal["llama3", "linear", "yarn"] = Field("llama3", description="RoPE frequency scaling rule")
    factor: float = Field(8.0, gt=0, description="context extension factor")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: low-frequency wavelength factor")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: high-frequency wavelength factor")
    original_max_position_embeddings: int = Field(8192, gt=0, description="context the base model was trained at")
    beta_fast: float = Field(32.0, gt=0, description="yarn: rotations above which a frequency is kept as it is")
    beta_slow: float = Field(1.0, gt=0, description="yarn: rotations below which a frequency is fully interpolated")
    mscale: float = Field(
        1.0, ge=0, description="yarn (DeepSeek): attention factor of the rotary dims, with mscale_all_dim"
    )
    mscale_all_dim: float = Field(
        0.0,
        ge=0,
        description="yarn, MLA: softmax scale × (0.1·mscale_all_dim·ln(factor) + 1)² (DeepSeek-V3: 1.0; 0: none)",
    )
    truncate: bool = Field(
        True,
        description="yarn: round the range of interpolated frequencies to whole dims (Hugging Face's default; "
        "GPT-OSS: false, no rounding)",
    )


class MoEConfig(Section):
    """Mixture-of-experts MLPs: each token goes to ``experts_per_token`` of ``num_experts`` SwiGLU experts (plus any
    shared experts every token takes), picked by a linear router. Layers before ``first_dense_layers``, and those off
    the ``layer_frequency`` rhythm, keep the dense MLP of ``model.ffn_hidden_size``."""

    num_experts: int = Field(8, gt=1, description="routed experts per MoE layer")
    experts_per_token: int = Field(2, gt=0, description="experts each token is routed to (top-k)")
    expert_ffn_hidden_size: int = Field(64, gt=0, description="SwiGLU inner width of one expert")
    shared_experts: int = Field(0, ge=0, description="experts every token also takes (DeepSeek / Qwen2-MoE style)")
    first_dense_layers: int = Field(0, ge=0, description="leading layers with the dense MLP (DeepSeek-V3: 3)")
    layer_frequency: int = Field(1, gt=0, description="every N-th layer after the dense ones is MoE (1: all)")
    router: Literal["softmax", "sigmoid"] = Field(
        "softmax",
        description="router score before top-k: softmax over experts (Qwen3, Mixtral) or sigmoid (DeepSeek-V3)",
    )
    normalize_topk: bool = Field(True, description="renormalise the top-k scores to sum to 1 (Qwen3, Mixtral)")
    balancing: Literal["aux_loss", "loss_free", "none"] = Field(
        "aux_loss",
        description="load balancing: an auxiliary loss (Switch / GShard), DeepSeek's bias-only loss-free balancing, "
        "or none",
    )
    aux_loss_coeff: float = Field(1e-3, ge=0, description="aux_loss: its weight in the loss (Qwen3 1e-3, Mixtral 2e-2)")
    seq_aux_loss_coeff: float = Field(
        0.0,
        ge=0,
        description="DeepSeek-V3's sequence-wise auxiliary loss, beside any balancing above: its weight (the paper's "
        "alpha: 1e-4; 0: off). An engine without one refuses it",
    )
    expert_groups: int = Field(
        1, gt=0, description="group-limited routing: the experts form this many groups (DeepSeek-V3: 8, n_group)"
    )
    groups_per_token: int = Field(
        1,
        gt=0,
        description="group-limited routing: a token's experts come from its best groups, ranked by the sum of each "
        "group's top 2 scores (DeepSeek-V3: 4, topk_group)",
    )
    scaling_factor: float = Field(
        1.0, gt=0, description="the routed experts' weights × this (DeepSeek-V3: 2.5, routed_scaling_factor)"
    )
    capacity_factor: float | None = Field(
        None, gt=0, description="tokens an expert takes, × the even share; beyond it tokens are dropped (null: none)"
    )
    router_bias: bool = Field(False, description="the router's linear has a bias of one per expert (GPT-OSS)")
    expert_bias: bool = Field(
        False, description="each expert's projections have biases: gate and up (2 × its width), down (d) (GPT-OSS)"
    )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether 0-based ``layer`` has routed experts."""
        return layer >= self.first_dense_layers and (layer - self.first_dense_layers) % self.layer_frequency == 0

    def num_moe_layers(self, num_layers: int) -> int:
        """How many of ``num_layers`` layers have routed experts (the count of :meth:`is_moe_layer`, in O(1): the
        planner asks it for every layout it weighs)."""
        return max(0, -(-(num_layers - self.first_dense_layers) // self.layer_frequency))


class MLAConfig(Section):
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank projection, keys and values
    from one compressed latent of ``kv_lora_rank`` (each with its RMSNorm); the query/key head is a part without
    position (``qk_nope_head_dim``) and a RoPE part (``qk_rope_head_dim``, the key's shared by all heads)."""

    q_lora_rank: int | None = Field(None, gt=0, description="query low-rank width (null: a full q projection)")
    kv_lora_rank: int = Field(512, gt=0, description="compressed key/value latent width (what a KV cache holds)")
    qk_nope_head_dim: int = Field(128, gt=0, description="per-head query/key dims without RoPE")
    qk_rope_head_dim: int = Field(64, gt=0, description="per-head query/key dims with RoPE (even)")
    v_head_dim: int = Field(128, gt=0, description="per-head value dims")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MTPConfig(Section):
    """Multi-token prediction (DeepSeek-V3): ``layers`` more blocks after the model's, depth k predicting the token k + 1
    ahead from depth k - 1's hidden states and the next token's embedding (the model's embedding and output head,
    shared). Their cross-entropy, times ``loss_scale`` / ``layers``, is added to the training loss; ``loss`` stays the
    main model's, ``mtp_loss`` is logged beside it."""

    layers: int = Field(1, gt=0, description="prediction depths (DeepSeek-V3: 1)")
    loss_scale: float = Field(0.1, gt=0, description="weight of their loss (DeepSeek-V3: 0.3, then 0.1)")


class ModelConfig(Section):
    name: str = Field("tiny-llama", description="preset name or a label for this architecture")
    family: Literal["llama", "qwen2", "qwen3", "mistral", "deepseek", "gpt_oss"] = Field(
        "llama", description="architecture family (decides qkv bias / qk-norm defaults in engines)"
    )
    hidden_size: int = Field(128, gt=0, description="model width d")
    num_layers: int = Field(2, gt=0, description="transformer blocks L")
    num_attention_heads: int = Field(4, gt=0, description="query heads")
    num_kv_heads: int = Field(2, gt=0, description="key/value heads (GQA); must divide num_attention_heads")
    head_dim: int | None = Field(None, gt=0, description="per-head dim; default hidden_size / heads")
    ffn_hidden_size: int = Field(352, gt=0, description="SwiGLU inner width")
    vocab_size: int = Field(2048, gt=0, description="embedding rows")
    max_position_embeddings: int = Field(2048, gt=0, description="longest context the RoPE tables cover")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE scaling for long context (Llama 3.1+)")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon")
    tie_word_embeddings: bool = Field(False, description="output head shares the input embedding")
    qkv_bias: bool = Field(False, description="bias on q/k/v projections (Qwen2.5)")
    attention_out_bias: bool = Field(
        False, description="bias on the attention output projection (o_proj; GPT-OSS, with qkv_bias)"
    )
    attention_sinks: bool = Field(
        False,
        description="a learned sink logit per query head in every attention layer: a softmax column that takes "
        "weight and gives no value (GPT-OSS)",
    )
    sliding_window: int | None = Field(
        None, gt=0, description="tokens a query attends back to (itself included) in its sliding layers (null: none)"
    )
    sliding_layers: Literal["all", "even"] = Field(
        "all",
        description="which layers use model.sliding_window: all, or the even ones (0-based: 0, 2, ...; the odd ones "
        "attend to the whole context; GPT-OSS, Hugging Face's layer_types)",
    )
    swiglu_limit: float | None = Field(
        None,
        gt=0,
        description="clamped SwiGLU (GPT-OSS: 7.0): gate ≤ limit, -limit ≤ up ≤ limit, out = (up + 1) · gate · "
        "sigmoid(1.702 · gate); null: the plain SwiGLU silu(gate) · up",
    )
    qk_norm: bool = Field(False, description="RMSNorm on per-head q and k (Qwen3)")
    init_std: float = Field(0.02, gt=0, description="std of the normal weight init")
    moe: MoEConfig | None = Field(None, description="mixture-of-experts MLPs (null: a dense model)")
    mla: MLAConfig | None = Field(None, description="multi-head latent attention (family deepseek; null: GQA)")
    mtp: MTPConfig | None = Field(None, description="multi-token prediction (family deepseek; null: none)")

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether 0-based ``layer`` attends through the sliding window (never without ``sliding_window``)."""
        return self.sliding_window is not None and (self.sliding_layers == "all" or layer % 2 == 0)


class OptimizerConfig(Section):
    name: Literal["adamw", "adam", "sgd"] = Field("adamw", description="optimizer")
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    min_lr: float = Field(3e-5, ge=0, description="learning rate at the end of decay")
    weight_decay: float = Field(0.1, ge=0, description="decoupled weight decay")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="Adam beta2")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon")


class ScheduleConfig(Section):
    warmup_steps: int = Field(2, ge=0, description="linear warmup steps")
    decay: Literal["cosine", "linear", "constant"] = Field("cosine", description="decay after warmup")
    decay_steps: int | None = Field(
        None, gt=0, description="steps from 0 to the end of decay (default train.steps); min_lr after them"
    )


class HealthConfig(Section):
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="NaN/Inf loss or grad norm: stop the run, or skip that step's update"
    )
    max_skipped_steps: int = Field(10, ge=0, description="with skip: stop after this many skipped steps")
    spike_factor: float = Field(3.0, gt=1, description="warn when the loss exceeds this × its recent mean")
    spike_window: int = Field(20, gt=1, description="steps in the recent-mean window")
    collective_timeout_s: int = Field(
        600, gt=0, description="a collective that takes longer aborts with an error instead of hanging"
    )


#: the projections LoRA adapts, by their Hugging Face module names (PEFT's ``target_modules``), and their role in
#: :func:`primus.core.hf.contract.layer_names`
LORA_TARGETS = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


class LoRAConfig(Section):
    """Low-rank adapters (LoRA, Hu et al. 2021; PEFT's defaults): each targeted projection ``W`` computes
    ``W x + (alpha / rank) · B A dropout(x)``, ``A`` [rank, in] drawn uniform in ±1/sqrt(in), ``B`` [out, rank] zero.
    The base weights are frozen (no gradients, no optimizer state); only ``A`` and ``B`` train. Targets are named by
    their Hugging Face modules, so one config means the same adapters on every engine and the adapters export to
    PEFT's format (``primus checkpoint export``)."""

    rank: int = Field(16, gt=0, description="r: the adapters' inner width")
    alpha: float = Field(32.0, gt=0, description="the adapters' output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (training only)")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description=f"Hugging Face module names to adapt in every layer; of {', '.join(LORA_TARGETS)}",
    )
    init_from: str | None = Field(
        None,
        description="a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start the adapters "
        "from, instead of PEFT's initial A and B; train.init_from names the base it was trained on",
    )

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, value: list[str]) -> list[str]:
        if bad := [t for t in value if t not in LORA_TARGETS]:
            raise ValueError(f"unknown module(s) {bad}; allowed: {', '.join(LORA_TARGETS)}")
        if len(set(value)) != len(value):
            raise ValueError(f"names a module twice: {value}")
        return value

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class TrainConfig(Section):
    seq_len: int = Field(128, gt=0, description="tokens per sample")
    micro_batch_size: int = Field(2, gt=0, description="samples per device per forward/backward")
    global_batch_size: int | None = Field(
        None, gt=0, description="samples per optimizer step (default micro_batch_size × data-parallel size)"
    )
    steps: int = Field(20, gt=0, description="optimizer steps")
    seed: int = Field(1234, ge=0, description=f"seed for init and data order, 0..{MAX_SEED}")
    precision: Literal["bf16", "fp32", "fp16"] = Field("bf16", description="compute dtype (params/optimizer fp32)")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    compile: bool = Field(False, description="torch.compile the blocks")
    init_from: str | None = Field(
        None,
        description="start from these weights: a Hugging Face folder (its config.json gives the model) or a Primus "
        "checkpoint of either engine (primus.core.run.init_from)",
    )
    save_initial: str | None = Field(
        None,
        description="write the weights this run starts from (after train.init / train.init_from, before step 1) "
        "into this folder, a weights-only checkpoint that train.init_from loads on any layout; then train",
    )
    objective: Literal["pretrain", "sft"] = Field(
        "pretrain",
        description="pretrain: next-token loss on every token; sft: fine-tuning on chat (messages, ShareGPT), "
        "Alpaca or prompt / completion records (data.record_format), loss on the answers only",
    )
    lora: LoRAConfig | None = Field(
        None,
        description="train low-rank adapters on the frozen base weights instead of the weights themselves (LoRA)",
    )
    init: Literal["canonical", "engine"] = Field(
        "canonical",
        description="initial weights: canonical = each tensor drawn from train.seed by its Hugging Face name, the "
        "same on every engine and layout (primus.core.run.initial_weights); engine = the engine's own init (the default of a "
        "model with shared experts, which have no Hugging Face mapping yet)",
    )
    health: HealthConfig = Field(default_factory=HealthConfig)
    max_minutes: float | None = Field(
        None,
        gt=0,
        description="wall-clock limit: once reached, finish the step, save a checkpoint and stop as if preempted",
    )
    allow_tight_fit: bool = Field(
        False,
        description="run a layout the memory model puts past the device's memory (beyond its error band): warned "
        "instead of refused (primus train checks before building anything)",
    )

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, value: int) -> int:
        if value > MAX_SEED:
            raise ValueError(
                f"must be 0..{MAX_SEED} (2**32 - 1): both engines seed torch's generators with it plus per-rank offsets"
            )
        return value


class ParallelConfig(Section):
    strategy: str = Field("manual", description="'manual' (sizes as given), 'auto' (planner picks), or a strategy name")
    dp_replicate: int = Field(1, gt=0, description="replicated data-parallel degree (DDP / HSDP replicas)")
    dp_shard: int | Auto = Field("auto", description="sharded data-parallel degree (FSDP); auto = the rest")
    tp: int = Field(1, gt=0, description="tensor-parallel degree")
    sequence_parallel: bool = Field(False, description="shard norms/dropout along the sequence (needs tp > 1)")
    pp: int = Field(1, gt=0, description="pipeline stages")
    vpp: int = Field(1, gt=0, description="virtual stages per pipeline rank (interleaved 1F1B)")
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe", "zero_bubble"] = Field(
        "1f1b", description="pipeline schedule"
    )
    cp: int = Field(1, gt=0, description="context-parallel degree")
    ep: int = Field(1, gt=0, description="expert-parallel degree: each MoE layer's experts split over ep ranks")
    distributed_optimizer: bool = Field(False, description="shard optimizer state across data-parallel ranks")
    fsdp: bool | Auto = Field(
        "auto",
        description="dp_shard > 1 shards parameters, gradients and optimizer state (FSDP2: true) or the optimizer "
        "state only (false: megatron's distributed optimizer); auto = the engine's default (torchtitan FSDP2, "
        "megatron the distributed optimizer)",
    )
    overlap_grad_reduce: bool = Field(False, description="overlap gradient reduce with backward")
    overlap_param_gather: bool = Field(False, description="overlap parameter all-gather with forward")
    reshard_after_forward: bool = Field(True, description="FSDP: free gathered params after forward")
    recompute: Literal["none", "selective", "full"] = Field("none", description="activation recompute")
    recompute_method: Literal["uniform", "block"] = Field(
        "uniform", description="full recompute: every layer group (uniform) or the first N layers (block)"
    )
    recompute_layers: int | None = Field(None, gt=0, description="layers per group (uniform) or N (block)")

    def shard_size(self, world_size: int) -> int:
        """``dp_shard``, with ``auto`` taken as the devices left by the other degrees (at least 1)."""
        if isinstance(self.dp_shard, int):
            return self.dp_shard
        return max(world_size // (self.dp_replicate * self.tp * self.pp * self.cp), 1)

    def sizes(self) -> dict[str, int | str]:
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
        }


KernelChoice = str  # "auto" or a provider name; checked against the installed providers


class Fp8Recipe(Section):
    grad_dtype: Literal["e4m3", "e5m2"] = Field(
        "e5m2", description="dtype of output gradients in the backward GEMMs (e5m2: more range, the usual hybrid)"
    )
    scaling: Literal["current", "delayed"] = Field(
        "current", description="scale from this step's amax (current) or from an amax history (delayed)"
    )
    amax_history: int = Field(16, gt=0, description="delayed scaling: steps of amax history")
    fast_accum_backward: bool = Field(
        False,
        description="backward FP8 GEMMs accumulate in the tensor cores' reduced precision as the forward does "
        "(faster; default: partial sums promoted to fp32)",
    )
    bf16_first_layers: int = Field(0, ge=0, description="first N transformer blocks keep bf16 linears")
    bf16_last_layers: int = Field(0, ge=0, description="last N transformer blocks keep bf16 linears")
    bf16_output_head: bool = Field(True, description="the output projection (vocab GEMM) stays bf16")
    implementation: Literal["auto", "primus", "torchao"] = Field(
        "auto", description="primus: primus-turbo's torch._scaled_mm linear; torchao: torchao.float8 where installed"
    )
    experts: Literal["auto", "fp8", "bf16"] = Field(
        "auto",
        description="a mixture-of-experts model's routed experts in the FP8 blocks: auto = FP8 grouped GEMMs only "
        "where the provider measured them faster than bf16 on this device, else bf16 (said in the kernel log); "
        "fp8 forces them (a warning gives the measured ratio); bf16 keeps them",
    )
    linears: Literal["auto", "all"] = Field(
        "auto",
        description="the block linears (and an FP8 output head) in FP8: auto = every one under train.compile, in "
        "eager mode only those whose weight (per rank) reaches 4096 x 4096, where FP8 was measured faster on an H100 "
        "(the others bf16, said in the kernel log); all = every one (FP8 numerics checks on small models)",
    )
    rocm_gemm: Literal["hipblaslt", "aiter"] = Field(
        "hipblaslt",
        description="ROCm, primus-turbo's linear: FP8 GEMMs on hipBLASLt (torch._scaled_mm) or AITER's gemm_a8w8 "
        "(CK; bf16/fp16 outputs, the fp32 weight gradients stay on hipBLASLt). Not run: no AMD GPU here",
    )


class KernelsConfig(Section):
    attention: KernelChoice = Field("auto", description="attention provider (auto = fastest available)")
    rms_norm: KernelChoice = Field("auto", description="RMSNorm provider")
    swiglu: KernelChoice = Field("auto", description="SwiGLU activation provider")
    cross_entropy: KernelChoice = Field("auto", description="(fused linear +) cross-entropy provider")
    rope: KernelChoice = Field("auto", description="rotary embedding provider")
    grouped_gemm: KernelChoice = Field("auto", description="mixture-of-experts grouped GEMM provider (the experts)")
    moe_permute: KernelChoice = Field(
        "auto", description="mixture-of-experts token permute / unpermute provider (tokens to experts' order and back)"
    )
    moe_router: KernelChoice = Field(
        "auto", description="mixture-of-experts router provider (scores, top-k experts, their weights)"
    )
    gemm_tuning: Literal["off", "online", "offline"] = Field("off", description="GEMM algorithm tuning mode")
    gemm_tuning_file: str | None = Field(None, description="offline tuning results file")
    gemm_tuning_mismatch: Literal["warn", "refuse"] = Field(
        "warn", description="offline: a results file made for another device / library version warns or refuses"
    )
    gemm_tuning_online_steps: int = Field(
        3, gt=0, description="online: steps during which new GEMM shapes are searched"
    )
    gemm_tuning_candidates: int = Field(16, gt=0, description="algorithms tried per GEMM shape")
    gemm_tuning_iterations: int = Field(20, gt=0, description="timing iterations per candidate")
    gemm_tuning_max_seconds: float = Field(60.0, gt=0, description="online: wall-clock cap on search per step")
    fp8: Literal["off", "tensorwise", "rowwise"] = Field(
        "off", description="FP8 (e4m3) linear GEMMs with dynamic scaling: one scale per tensor or per row"
    )
    fp8_recipe: Fp8Recipe = Field(default_factory=lambda: Fp8Recipe())

    @field_validator("gemm_tuning", "fp8", mode="before")
    @classmethod
    def _off_is_not_false(cls, value: Any) -> Any:
        # YAML 1.1 (PyYAML) reads a bare `off` as false; here it can only mean the mode "off"
        return "off" if value is False else value


class BlendSource(Section):
    weight: float = Field(gt=0, description="share of the samples drawn from this source (weights are normalised)")
    path: str = Field(description="a file, folder, glob or Megatron prefix, read like data.source")


class DataConfig(Section):
    source: str = Field("bundled", description="'bundled' (embedded corpus), 'mock' (random tokens), or a path / glob")
    blend: list[BlendSource] = Field(
        default_factory=list,
        description="weighted sources instead of data.source: [{weight: 0.3, path: a}, ...] or Megatron's "
        "[0.3, a, 0.7, b]; each sample's source is drawn by weight from train.seed",
    )
    paths: list[str] = Field(
        default_factory=list, description="extra files or folders (.jsonl/.json/.txt/.parquet/.arrow/.bin)"
    )
    format: Literal["auto", "jsonl", "json", "txt", "parquet", "arrow", "megatron"] = Field(
        "auto",
        description="file format (auto: by extension; json: a JSON array of records; a save_to_disk folder is arrow)",
    )
    record_format: Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion"] = Field(
        "auto",
        description="train.objective sft: the kind of every record, auto = each record's keys tell it; "
        "messages {messages: [{role, content}]}, sharegpt {conversations: [{from, value}]} (from human / gpt / "
        "system), alpaca {instruction, input, output}, prompt_completion {prompt, completion}",
    )
    sft_packing: Literal["stream", "padded", "packed"] = Field(
        "stream",
        description="train.objective sft: how chats become samples. stream: one token stream cut into "
        "train.seq_len windows (chats run across windows and attend to each other); padded: one chat per sample, "
        "padded; packed: whole chats packed first-fit in data order, attention kept inside each chat (needs an "
        "attention provider that masks by document). padded / packed truncate a chat longer than train.seq_len + 1 "
        "tokens",
    )
    text_key: str = Field("text", description="field holding the text in .jsonl/.json/.parquet/.arrow (pretraining)")
    tokenizer: str = Field("bundled", description="'bundled' or a folder / tokenizer.json path")
    num_workers: int = Field(0, ge=0, description="data loader worker processes")
    document_mask: bool = Field(
        False,
        description="packed samples: each token attends only to earlier tokens of its own document (documents end "
        "at the tokenizer's EOS token); needs an attention provider that masks by document",
    )

    @field_validator("blend", mode="before")
    @classmethod
    def _weight_path_pairs(cls, value: Any) -> Any:
        # Megatron's `--data-path 0.3 a 0.7 b`: a string or a flat list, weight before path
        if isinstance(value, str):
            value = value.split()
        if isinstance(value, list) and value and not isinstance(value[0], dict):
            if len(value) % 2:
                raise ValueError("Megatron's form is weight path pairs: [0.3, a, 0.7, b]")
            pairs = []
            for weight, path in zip(value[::2], value[1::2], strict=True):
                try:
                    pairs.append({"weight": float(weight), "path": str(path)})
                except (TypeError, ValueError):
                    raise ValueError(f"{weight!r} is not a weight (weight path pairs: [0.3, a, 0.7, b])") from None
            return pairs
        return value


class CheckpointConfig(Section):
    enabled: bool = Field(True, description="save checkpoints")
    dir: str | None = Field(None, description="checkpoint folder (default <output_dir>/checkpoints)")
    interval: int = Field(0, ge=0, description="save every N steps (0: only at the end)")
    keep_last: int = Field(2, gt=0, description="checkpoints kept")
    resume: bool | Literal["auto"] = Field(
        False,
        description="continue from the newest complete checkpoint; auto: when there is one, else start fresh "
        "(a requeued job simply runs again)",
    )
    allow_data_change: bool = Field(
        False,
        description="resume although the data sources, blend weights, train.seed, train.seq_len, eval.holdout or "
        "data.sft_packing changed since the checkpoint (the data order then changes; a warning names what changed); "
        "without it such a resume is refused. A changed train.global_batch_size is always refused",
    )


class EvalConfig(Section):
    interval: int = Field(0, ge=0, description="evaluate every N steps and at the last step (0: no evaluation)")
    batches: int = Field(4, gt=0, description="global batches (of train.global_batch_size samples) per evaluation")
    holdout: float = Field(
        0.0, ge=0, lt=1, description="fraction of the training samples held out for evaluation (never trained on)"
    )
    source: str | None = Field(None, description="separate evaluation data: a path / glob, read like data.source")
    paths: list[str] = Field(default_factory=list, description="more evaluation files or folders")


class LoggingConfig(Section):
    output_dir: str | None = Field(
        None,
        description="run folder (default outputs/<recipe>: the recipe's or config file's name; else outputs/<model.name>)",
    )
    interval: int = Field(1, gt=0, description="steps per metrics line")
    tensorboard: bool = Field(True, description="write TensorBoard events")
    jsonl: bool = Field(True, description="write metrics.jsonl")
    progress: bool = Field(True, description="show a progress bar on rank 0")
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    loggers: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="loggers that plugins provide, by name, each with its settings; one is on when named here "
        "(primus-loggers: wandb, mlflow; e.g. {wandb: {project: x, mode: offline}})",
    )


class ProfileConfig(Section):
    enabled: bool = Field(False, description="run torch.profiler")
    wait: int = Field(1, ge=0, description="profiler wait steps")
    warmup: int = Field(1, ge=0, description="profiler warmup steps")
    active: int = Field(2, gt=0, description="profiled steps")
    ranks: list[int] = Field(default_factory=lambda: [0], description="ranks that write a trace")


class ClusterConfig(Section):
    device: str | None = Field(None, description="the GPU a recipe was written for (H100, H200, MI300X, ...)")
    nodes: int = Field(1, gt=0, description="nodes the recipe was written for")
    gpus_per_node: int = Field(8, gt=0, description="GPUs per node the recipe was written for")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


class BackendConfig(Section):
    name: str = Field("torchtitan", description="training engine (a registered backend)")
    extra: dict[str, Any] = Field(default_factory=dict, description="passed to the engine unchanged")


class PrimusConfig(Section):
    description: str = Field("", description="what this config is for")
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    cluster: ClusterConfig | None = Field(
        None, description="where a recipe is meant to run; primus plan and config validate read it when not told"
    )


# What makes two models' checkpoints interchangeable (every layout of the same shape can load it).
SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "kv_channels",
    "ffn_hidden_size",
    "vocab_size",
    "tie_word_embeddings",
    "qkv_bias",
    "qk_norm",
)
