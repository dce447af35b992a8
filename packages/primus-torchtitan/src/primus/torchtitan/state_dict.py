"""Hugging Face names <-> torchtitan's model state, per model family: torchtitan's own state-dict adapters, and
Primus's for what they lack (:mod:`primus.torchtitan.hf` reads and writes folders with them; :mod:`primus.torchtitan.lora`
maps its adapters' rows through them).

- ``llama3`` (Llama 3.x, Mistral): torchtitan's ``Llama3StateDictAdapter``. torchtitan's llama3 applies RoPE to
  interleaved (complex) pairs, HF to rotate-half halves: the adapter permutes the rows of ``wq`` / ``wk``.
- ``qwen3``: torchtitan's ``Qwen3StateDictAdapter`` (its RoPE is rotate-half already: no permutation; it ties
  the head to the embedding when the HF folder has no ``lm_head``).
- ``dense`` (Primus's llama3 with qkv bias / tied embeddings, :mod:`primus.torchtitan.dense`):
  :class:`DenseStateDictAdapter`, the llama3 adapter plus the q/k/v biases (q and k biases permuted like their
  weights) and the tied head.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from primus.core.config.schema import PrimusConfig
from primus.torchtitan import compat

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.models.deepseek_v3.model.state_dict_adapter import DeepSeekV3StateDictAdapter  # noqa: E402
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter  # noqa: E402

_NOT_IN_HF = ("moe.expert_bias",)  # model state with no HF tensor (Qwen3-MoE has no routing bias)
_QK_BIAS = re.compile(r"^layers\.(\d+)\.attention\.w([qk])\.bias$")
_HF_QK_BIAS = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qk])_proj\.bias$")


class DenseStateDictAdapter(Llama3StateDictAdapter):
    """Llama3's adapter for :class:`primus.torchtitan.dense.DenseTransformer`: plus q/k/v biases and tying."""

    def __init__(self, model_args: Any, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        for p in "qkv":
            self.from_hf_map[f"model.layers.{{}}.self_attn.{p}_proj.bias"] = f"layers.{{}}.attention.w{p}.bias"

    def _bias_heads(self, which: str) -> int:
        a = self.model_args
        return a.n_heads if which == "q" else (a.n_kv_heads or a.n_heads)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        sd = dict(state_dict)
        if self.model_args.tie_word_embeddings:
            sd.pop("output.weight", None)
        biases = {k: sd.pop(k) for k in list(sd) if _QK_BIAS.match(k)}
        out = super().to_hf(sd)
        for key, b in biases.items():
            layer, which = _QK_BIAS.match(key).groups()
            permuted = self._permute(b.unsqueeze(-1), self._bias_heads(which), b.shape[0], 1).squeeze(-1)
            out[f"model.layers.{layer}.self_attn.{which}_proj.bias"] = permuted
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        sd = dict(hf_state_dict)
        biases = {k: sd.pop(k) for k in list(sd) if _HF_QK_BIAS.match(k)}
        out = super().from_hf(sd)
        for key, b in biases.items():
            layer, which = _HF_QK_BIAS.match(key).groups()
            permuted = self._reverse_permute(b.unsqueeze(-1), self._bias_heads(which), b.shape[0], 1).squeeze(-1)
            out[f"layers.{layer}.attention.w{which}.bias"] = permuted
        if self.model_args.tie_word_embeddings:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out


class Qwen3SharedExpertsStateDictAdapter(Qwen3StateDictAdapter):
    """qwen3's adapter plus the shared experts (``moe.shared_experts.w1 / w3 / w2``, one FeedForward), under core's
    names for them (:data:`primus.core.hf.contract.SHARED_NAMES`, DeepSeek's; Qwen3-MoE has none)."""

    def __init__(self, model_args: Any, hf_assets_path: str | None):
        from primus.core.hf.contract import SHARED_NAMES

        super().__init__(model_args, hf_assets_path)
        for role, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            self.from_hf_map[f"model.layers.{{}}.{SHARED_NAMES[role]}"] = f"layers.{{}}.moe.shared_experts.{w}.weight"


ADAPTERS = {
    "llama3": Llama3StateDictAdapter,
    "qwen3": Qwen3SharedExpertsStateDictAdapter,
    "dense": DenseStateDictAdapter,
    "deepseek_v3": DeepSeekV3StateDictAdapter,  # interleaved RoPE pairs on both sides: no permutation
}


def adapter_cls(m: Any) -> type:
    from primus.torchtitan.models import engine_model

    return ADAPTERS[engine_model(m)]


def adapter(cfg: PrimusConfig, hf_dir: str | Path | None = None) -> Any:
    from primus.torchtitan.models import model_args

    return adapter_cls(cfg.model)(model_args(cfg.model, cfg.train.seq_len), str(hf_dir) if hf_dir else None)
