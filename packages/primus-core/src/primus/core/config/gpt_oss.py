"""GPT-OSS's architecture in core (``model.family: gpt_oss``; openai/gpt-oss-20b and -120b).

Its parts beyond a Qwen3-MoE-shaped model, each a ``model`` key (default off, so no other preset changes):

  attention_sinks      a learned logit per query head in each attention layer's softmax (``self_attn.sinks`` [h])
  sliding_window       128 tokens, on the even layers (``sliding_layers: even``; Hugging Face's ``layer_types``)
  qkv_bias, attention_out_bias   biases on q, k, v and o (Hugging Face's ``attention_bias``)
  moe.router_bias      the router's linear has a bias [E]
  moe.expert_bias      each expert's gate / up ([2·e]) and down ([d]) projections have biases
  swiglu_limit         the clamped SwiGLU: (clamp(up, ±7) + 1) · g · sigmoid(1.702 · g), g = min(gate, 7)
  rope_scaling.truncate  YaRN without rounding the interpolated range (false)

Core plans such a model (counts, FLOPs, memory); no engine builds it yet: each backend's validation refuses it by
name with what it lacks (:func:`refusal`), and Hugging Face import / export is not mapped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from primus.core.contracts.protocols import ConfigIssue

if TYPE_CHECKING:
    from primus.core.config.schema import ModelConfig

FAMILY = "gpt_oss"


def parts(m: ModelConfig) -> dict[str, Any]:
    """The GPT-OSS parts ``m`` sets, by key (their value): an engine that builds none of them refuses each."""
    out: dict[str, Any] = {}
    for key in ("attention_sinks", "attention_out_bias", "sliding_window", "swiglu_limit"):
        if getattr(m, key) not in (None, False):
            out[f"model.{key}"] = getattr(m, key)
    if m.moe is not None:
        for key in ("router_bias", "expert_bias"):
            if getattr(m.moe, key):
                out[f"model.moe.{key}"] = True
    if m.rope_scaling is not None and not m.rope_scaling.truncate:
        out["model.rope_scaling.truncate"] = False
    return out


def refusal(engine: str, lacks: str, families: frozenset[str]) -> ConfigIssue:
    """One engine's refusal of family gpt_oss: at ``model.family``, saying what ``engine`` lacks."""
    why = (
        f"{engine} cannot build GPT-OSS models yet: {lacks}; Primus plans them (primus plan), training them and "
        "their Hugging Face import / export are not there yet"
    )
    return ConfigIssue("model.family", why, value=FAMILY, allowed=", ".join(sorted(families)))


def part_issues(m: ModelConfig, engine: str) -> list[ConfigIssue]:
    """An engine that builds no GPT-OSS part refuses each one a model of another family sets (a part ignored would
    train another model than the one asked for)."""
    if m.family == FAMILY:
        return []
    return [
        ConfigIssue(key, f"{engine} does not build it (GPT-OSS's; no engine trains it yet)", value, "its default")
        for key, value in parts(m).items()
    ]


def issues(m: ModelConfig) -> list[ConfigIssue]:
    """The config rules of GPT-OSS's parts, each at the key a user would change."""
    out: list[ConfigIssue] = []
    if m.sliding_window is None and m.sliding_layers != "all":
        why = "names which layers slide, and there is no window"
        out.append(ConfigIssue("model.sliding_layers", why, m.sliding_layers, "all, or set model.sliding_window"))
    if m.sliding_window is not None and m.sliding_window >= m.max_position_embeddings:
        why = f"a window as long as the context (model.max_position_embeddings {m.max_position_embeddings}) is none"
        out.append(ConfigIssue("model.sliding_window", why, m.sliding_window, f"1..{m.max_position_embeddings - 1}"))
    if m.attention_sinks and m.mla is not None:
        why = "GPT-OSS's sinks are for its grouped-query attention, not multi-head latent attention"
        out.append(ConfigIssue("model.attention_sinks", why, True, "false with model.mla"))
    if m.family == FAMILY and m.moe is None:
        out.append(ConfigIssue("model.moe", "every GPT-OSS MLP is a mixture of experts", None, "a model.moe section"))
    return out
