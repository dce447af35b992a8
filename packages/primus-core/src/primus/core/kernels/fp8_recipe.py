"""What an FP8 linear does, from the config's ``kernels.fp8`` / ``kernels.fp8_recipe`` (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from primus.core.contracts.protocols import ConfigIssue

E4M3_MAX = 448.0  # torch.float8_e4m3fn
E5M2_MAX = 57344.0  # torch.float8_e5m2
# the OCP formats (NVIDIA, AMD gfx950) and AMD's fnuz variants (gfx942, the MI300 series: no negative zero, one
# NaN, exponent bias one higher, so e4m3fnuz tops out at 240)
FP8_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX, "e4m3fnuz": 240.0, "e5m2fnuz": 57344.0}
GEMM_ALIGN = 16  # torch._scaled_mm on CUDA: every GEMM dim a multiple of 16
# what a run's kernel plan says of a mixture-of-experts model's experts under kernels.fp8 (the limits of torch's
# grouped FP8 kernel, which primus-turbo's grouped GEMM follows on every device)
FP8_EXPERTS_NOTE = "routed experts on FP8 grouped GEMMs (e4m3 gradients, bf16 out)"


def fp8_blocks(num_layers: int, bf16_first: int, bf16_last: int) -> range:
    """0-based indices of the transformer blocks whose linears run in FP8: all but the recipe's first
    ``bf16_first`` and last ``bf16_last`` (empty when those cover every block)."""
    return range(bf16_first, num_layers - bf16_last)


# The smallest weight (in_features x out_features, one rank's share) whose linear runs faster in FP8 than in bf16 in
# eager mode, forward + backward at 8192 tokens (H100, results/fp8_linear_overhead_h100.json); compiled, inductor
# fuses the casts and whole runs pay with every linear in FP8. The measurements: benchmarks/README.md, "Calibration
# notes".
FP8_MIN_WEIGHT_EAGER = 4096 * 4096
# The tokens of one GEMM call that bound was measured at. What pays is the GPU work of a call, tokens x weight: with
# fewer tokens a micro-batch the same weight's FP8 GEMMs save less than its quantisation and launches cost. Measured:
# a DeepSeek-V3-architecture model (4 blocks of Moonlight-16B-A3B) at 4096 tokens a micro-batch, whose dense MLP
# (2048 x 11264) alone reaches the weight bound, trained at 0.95-0.99x bf16 with it in FP8 on TorchTitan (H200,
# benchmarks/results/deepseek_fp8.json).
FP8_RULE_TOKENS = 8192


def fp8_linear_pays(in_features: int, out_features: int, *, compiled: bool, tokens: int = FP8_RULE_TOKENS) -> bool:
    """Whether a linear of this (per-rank) shape, called on ``tokens`` tokens (a micro-batch's, on this rank), is
    measured faster in FP8 than in bf16 (see :data:`FP8_MIN_WEIGHT_EAGER`, :data:`FP8_RULE_TOKENS`)."""
    return compiled or in_features * out_features * tokens >= FP8_MIN_WEIGHT_EAGER * FP8_RULE_TOKENS


def call_tokens(micro_batch: int, seq_len: int, cp: int) -> int:
    """The tokens one linear of a block multiplies per call on one rank: a micro-batch's, its sequence split over
    ``cp`` context-parallel ranks (sequence parallelism gathers them back before the column-parallel GEMMs)."""
    return micro_batch * seq_len // cp


def gemm_tokens(cfg: Any) -> int:
    """:func:`call_tokens` of a run's config."""
    return call_tokens(cfg.train.micro_batch_size, cfg.train.seq_len, cfg.parallel.cp)


def fp8_linear_rule(kernels: Any, *, compiled: bool, tokens: int = FP8_RULE_TOKENS) -> Any:
    """``(in_features, out_features) -> bool``: whether a linear of an FP8 block runs in FP8 under
    ``kernels.fp8_recipe.linears`` (``auto``: :func:`fp8_linear_pays` at ``tokens`` a call; ``all``: every one)."""
    if kernels.fp8_recipe.linears == "all":
        return lambda in_features, out_features: True
    return lambda in_features, out_features: fp8_linear_pays(
        in_features, out_features, compiled=compiled, tokens=tokens
    )


def fp8_linears_note(kept: int, total: int) -> str:
    """The kernel log's words for ``kept`` of ``total`` block linears left in bf16 by ``linears: auto``."""
    return (
        f"{kept} of {total} linears stay bf16: eager, FP8 is measured slower below in x out = "
        f"{FP8_MIN_WEIGHT_EAGER:,} at {FP8_RULE_TOKENS:,} tokens a micro-batch, in proportion at others "
        "(train.compile: true fuses its casts; kernels.fp8_recipe.linears: all forces them)"
    )


def fp8_output_head(kernels: Any) -> bool:
    """Whether the output projection runs in FP8 too (``kernels.fp8`` on and ``bf16_output_head: false``)."""
    return kernels.fp8 != "off" and not kernels.fp8_recipe.bf16_output_head


@dataclass(frozen=True)
class Fp8Recipe:
    """``mode``: one scale per tensor (``tensorwise``) or per row of each operand along the reduction dim
    (``rowwise``); ``grad_dtype``: the output gradient's fp8 format in the two backward GEMMs;
    ``scaling``: ``current`` (this step's amax) or ``delayed`` (max of the last ``amax_history`` steps,
    tensorwise only); ``fast_accum_backward``: the two backward GEMMs accumulate as the forward does, in the
    tensor cores' reduced precision, instead of promoting partial sums to fp32 (faster, less exact);
    ``rocm_gemm``: on ROCm, ``hipblaslt`` (torch._scaled_mm) or ``aiter`` (AITER's gemm_a8w8 where the output is
    bf16/fp16). Two fields come from the run, not the config: ``fnuz``, set by primus-turbo on the MI300 series
    (gfx942), whose FP8 GEMMs take the fnuz formats (:attr:`forward_format`, :attr:`grad_format`); and
    ``fp8_all_gather``, set by the torchtitan backend where FSDP2 can all-gather the weights in FP8 (torchao's
    tensorwise linear)."""

    mode: Literal["tensorwise", "rowwise"] = "tensorwise"
    grad_dtype: Literal["e4m3", "e5m2"] = "e5m2"
    scaling: Literal["current", "delayed"] = "current"
    amax_history: int = 16
    fast_accum_backward: bool = False
    rocm_gemm: Literal["hipblaslt", "aiter"] = "hipblaslt"
    fnuz: bool = False
    fp8_all_gather: bool = False

    # fields that come from the device and the run's layout, not from the config section
    RUN_FIELDS = ("fnuz", "fp8_all_gather")

    def __post_init__(self) -> None:
        if self.mode not in ("tensorwise", "rowwise"):
            raise ValueError(f"fp8 mode must be tensorwise or rowwise (got {self.mode!r})")
        if self.grad_dtype not in ("e4m3", "e5m2"):
            raise ValueError(f"fp8 grad_dtype must be e4m3 or e5m2 (got {self.grad_dtype!r})")
        if self.scaling == "delayed" and self.mode == "rowwise":
            raise ValueError(delayed_rowwise_reason())
        if self.amax_history < 1:
            raise ValueError(f"amax_history must be >= 1 (got {self.amax_history})")
        if self.rocm_gemm not in ("hipblaslt", "aiter"):
            raise ValueError(f"fp8 rocm_gemm must be hipblaslt or aiter (got {self.rocm_gemm!r})")

    @property
    def forward_format(self) -> str:
        """The fp8 format of the forward operands and of every e4m3 operand of the backward."""
        return "e4m3fnuz" if self.fnuz else "e4m3"

    @property
    def grad_format(self) -> str:
        """The fp8 format of the output gradient in the backward GEMMs."""
        return self.grad_dtype + ("fnuz" if self.fnuz else "")

    @classmethod
    def from_config(cls, kernels: Any) -> Fp8Recipe | None:
        """From a :class:`primus.core.config.schema.KernelsConfig`; None when ``kernels.fp8`` is off."""
        if kernels.fp8 == "off":
            return None
        # every field but the mode and the run's is the config section's field of the same name
        skip = ("mode", *cls.RUN_FIELDS)
        gemm = {f.name: getattr(kernels.fp8_recipe, f.name) for f in fields(cls) if f.name not in skip}
        return cls(mode=kernels.fp8, **gemm)


def delayed_rowwise_reason() -> str:
    return (
        "delayed scaling keeps one amax history per tensor; rowwise scales belong to rows of activations "
        "that change every batch (use scaling: current with rowwise, or tensorwise with delayed)"
    )


def config_issues(cfg: Any, *, engine: str) -> list[Any]:
    """What both engines refuse for ``kernels.fp8`` (without importing torch): fp32 compute, delayed
    rowwise, delayed under torch.compile, no block left in FP8, GEMM dims ``_scaled_mm`` cannot take
    (each named), and for a mixture-of-experts model what its FP8 experts cannot do (:func:`_moe_issues`)."""
    k, m, t = cfg.kernels, cfg.model, cfg.train
    if k.fp8 == "off":
        return []
    r = k.fp8_recipe
    out = []
    if t.precision == "fp32":
        out.append(
            ConfigIssue(
                "train.precision",
                "kernels.fp8 casts the GEMM operands of a bf16 run; with fp32 compute there is no bf16 "
                "baseline to speed up and the comparison is meaningless",
                value="fp32",
                allowed="bf16 (or kernels.fp8: off)",
            )
        )
    if r.scaling == "delayed" and k.fp8 == "rowwise":
        out.append(ConfigIssue("kernels.fp8_recipe.scaling", delayed_rowwise_reason(), value="delayed"))
    if r.scaling == "delayed" and t.compile:
        out.append(
            ConfigIssue(
                "kernels.fp8_recipe.scaling",
                "delayed scaling updates amax histories held outside the model inside the FP8 linear's autograd "
                "function, which torch.compile cannot trace as one graph",
                value="delayed",
                allowed="current with train.compile, or train.compile: false",
            )
        )
    if not fp8_blocks(m.num_layers, r.bf16_first_layers, r.bf16_last_layers):
        out.append(
            ConfigIssue(
                "kernels.fp8_recipe.bf16_first_layers",
                f"bf16_first_layers + bf16_last_layers = {r.bf16_first_layers + r.bf16_last_layers} leaves none of "
                f"the {m.num_layers} blocks in FP8",
                allowed=f"a sum below {m.num_layers}",
            )
        )
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    dims = {
        "model.hidden_size (every linear's in or out features)": m.hidden_size,
        "model.ffn_hidden_size (w1/w3 out, w2 in)": m.ffn_hidden_size,
        "query projection width (num_attention_heads × head_dim)": m.num_attention_heads * head_dim,
        "key/value projection width (num_kv_heads × head_dim)": m.num_kv_heads * head_dim,
        "tokens per micro-batch (train.seq_len × train.micro_batch_size; the weight-gradient GEMM's reduction dim)": (
            t.seq_len * t.micro_batch_size
        ),
    }
    if not r.bf16_output_head:
        dims["model.vocab_size (output head out features)"] = m.vocab_size
    if m.moe is not None:
        dims["model.moe.expert_ffn_hidden_size (each expert's width)"] = m.moe.expert_ffn_hidden_size
        out.extend(_moe_issues(k))
    for what, dim in dims.items():
        if dim % GEMM_ALIGN:
            out.append(
                ConfigIssue(
                    "kernels.fp8",
                    f"{engine}: {what} is {dim}, not a multiple of {GEMM_ALIGN} (torch._scaled_mm needs every "
                    "FP8 GEMM dim to be)",
                    value=k.fp8,
                    allowed="off, or dims that are multiples of 16",
                )
            )
    return out


def _moe_issues(k: Any) -> list[Any]:
    """FP8 experts run on the FP8 provider's grouped GEMM (primus-turbo's: ``torch._scaled_grouped_mm``), which scales
    by the current amax only (delayed histories would be one per expert and group of tokens); torchao's FP8 provider
    swaps ``nn.Linear`` modules only and has no grouped GEMM here."""
    out = []
    if k.fp8_recipe.scaling == "delayed":
        why = "a mixture-of-experts model's FP8 experts scale by the current amax (no history per expert and group)"
        out.append(ConfigIssue("kernels.fp8_recipe.scaling", why, value="delayed", allowed="current"))
    if k.fp8_recipe.implementation == "torchao":
        why = "torchao's FP8 provider has no grouped GEMM for a mixture-of-experts model's experts here"
        out.append(ConfigIssue("kernels.fp8_recipe.implementation", why, value="torchao", allowed="primus or auto"))
    return out
