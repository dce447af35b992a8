"""The name-mapping contract between core and the backends, and the operations built on it.

Every backend maps its own parameter names and layouts from and to the *HF names* below (the tensors of a
``transformers`` Llama / Qwen2 / Qwen3 / Mistral ``*ForCausalLM``, and for mixture-of-experts layers Qwen3-MoE's
``mlp.gate`` / ``mlp.experts.{j}.*_proj`` or Mixtral's ``block_sparse_moe.gate`` / ``block_sparse_moe.experts.{j}.w1-3``
names, one tensor per expert as the Hub checkpoints hold them), so core reads and writes HF folders
without knowing any engine. A backend offers this through ``BackendSpec.hf``: a ``"module:attr"`` naming an
object with the :class:`HFInterop` methods (imported only when used; core imports no engine).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from primus.core.errors import UserError

if TYPE_CHECKING:
    from primus.core.config.schema import ModelConfig, PrimusConfig
    from primus.core.plugins import Registry

log = logging.getLogger("primus.hf")

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


# mixture-of-experts naming per family: (router, expert j's tensor of each role); Mixtral's for llama / mistral
_MOE_NAMES = {
    "qwen": ("mlp.gate.weight", {r: f"mlp.experts.{{j}}.{r}_proj.weight" for r in ("gate", "up", "down")}),
    "mixtral": (
        "block_sparse_moe.gate.weight",
        {r: f"block_sparse_moe.experts.{{j}}.{w}.weight" for r, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))},
    ),
}


# shared experts (model.moe.shared_experts, one SwiGLU MLP of shared_experts x expert_ffn_hidden_size every token takes),
# named as DeepSeek-V2/V3 checkpoints hold them; no Qwen3-MoE or Mixtral checkpoint has them (HF interop refuses them)
SHARED_NAMES = {r: f"mlp.shared_experts.{r}_proj.weight" for r in ("gate", "up", "down")}


def expert_role(j: int, role: str) -> str:
    """The role name of routed expert ``j``'s ``role`` (``gate``, ``up`` or ``down``) in :func:`layer_names`."""
    return f"experts.{j}.{role}"


def _mlp_names(m: ModelConfig, i: int, p: str) -> dict[str, str]:
    if m.moe is None or not m.moe.is_moe_layer(i):
        return {r: p + f"mlp.{r}_proj.weight" for r in ("gate", "up", "down")}
    router, expert = _MOE_NAMES["qwen" if m.family.startswith("qwen") else "mixtral"]
    names = {"router": p + router}
    for j in range(m.moe.num_experts):
        names |= {expert_role(j, r): p + expert[r].format(j=j) for r in ("gate", "up", "down")}
    if m.moe.shared_experts:
        names |= {f"shared.{r}": p + name for r, name in SHARED_NAMES.items()}
    return names


def layer_names(m: ModelConfig, i: int) -> dict[str, str]:
    """Role -> HF name of the tensors of layer ``i`` this architecture has. A mixture-of-experts layer has
    ``router`` and :func:`expert_role` ``(j, gate|up|down)`` in place of the dense ``gate``, ``up``, ``down``, and
    ``shared.gate|up|down`` with shared experts (:data:`SHARED_NAMES`: canonical initial weights; HF interop refuses
    them)."""
    p = f"model.layers.{i}."
    names = {
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
        **_mlp_names(m, i, p),
        "input_norm": p + "input_layernorm.weight",
        "post_norm": p + "post_attention_layernorm.weight",
    }
    if m.qkv_bias:
        names |= {"q_bias": p + "self_attn.q_proj.bias", "k_bias": p + "self_attn.k_proj.bias"}
        names |= {"v_bias": p + "self_attn.v_proj.bias"}
    if m.qk_norm:
        names |= {"q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"}
    return names


def hf_names(m: ModelConfig) -> list[str]:
    """Every tensor name of the HF model (``lm_head`` only when the head is not tied)."""
    names = [EMBED]
    for i in range(m.num_layers):
        names += list(layer_names(m, i).values())
    names.append(FINAL_NORM)
    if not m.tie_word_embeddings:
        names.append(LM_HEAD)
    return names


class HFInterop(Protocol):
    """What a backend implements (``BackendSpec.hf``). Tensors are exchanged under :func:`hf_names`."""

    def import_hf(self, cfg: PrimusConfig, hf_dir: Path, out: Path) -> Path:
        """Write the weights of the HF folder ``hf_dir`` as this engine's checkpoint under ``out``; returns the
        checkpoint folder a run starts from (``cfg.model`` already describes ``hf_dir``'s architecture)."""
        ...

    def export_hf(self, cfg: PrimusConfig, checkpoint: Path) -> dict[str, Any]:
        """The model weights of this engine's checkpoint ``checkpoint`` as HF-named CPU tensors."""
        ...


# A checkpoint is read (and an import written) by one process: a run's layout does not apply, nor where its
# weights came from (the folder of train.init_from may be gone by then).
OFFLINE_OVERRIDES = (
    "parallel.strategy=manual",
    "parallel.dp_replicate=1",
    "parallel.dp_shard=auto",
    "parallel.tp=1",
    "parallel.pp=1",
    "parallel.vpp=1",
    "parallel.cp=1",
    "parallel.sequence_parallel=false",
    "train.init_from=null",
)


def _registry() -> Registry:
    """The process's registry, for a top-level call that was handed none."""
    from primus.core.plugins import get_registry

    return get_registry()


def interop(cfg: PrimusConfig, registry: Registry) -> HFInterop:
    """The HF importer/exporter of ``cfg.backend.name``; a clear error when the backend has none."""
    from primus.core.protocols import load_ref

    spec = registry.backends.get(cfg.backend.name)
    if spec is None:
        raise UserError(f"backend.name {cfg.backend.name!r} is not installed; allowed: {', '.join(registry.backends)}")
    ref = getattr(spec, "hf", None)
    if ref is None:
        with_hf = [n for n, s in registry.backends.items() if getattr(s, "hf", None) is not None]
        raise UserError(
            f"backend.name {cfg.backend.name!r} has no Hugging Face importer/exporter; allowed: {', '.join(with_hf)}"
        )
    return load_ref(ref)


def tokenizer_source(cfg: PrimusConfig) -> Path | None:
    """The tokenizer.json the run used (the bundled one from its cache), or None."""
    spec = cfg.data.tokenizer
    if spec == "bundled":
        from primus.core.data.tokenizer import bundled_dir, load_tokenizer

        load_tokenizer(spec)  # make sure the cache holds it
        return bundled_dir() / "tokenizer.json"
    path = Path(spec).expanduser()
    path = path / "tokenizer.json" if path.is_dir() else path
    return path if path.is_file() else None


def import_checkpoint(
    cfg: PrimusConfig, hf_dir: str | Path, out: str | Path, *, registry: Registry | None = None
) -> Path:
    """HF folder -> the checkpoint of ``cfg.backend.name`` under ``out`` (``cfg.model`` must describe it).

    ``registry``: the installed plugins' (the CLI's); the process's own when not given."""
    from primus.core.hf.config import check_matches
    from primus.core.hf.safetensors_io import HFReader, missing

    reader = HFReader(hf_dir)
    check_matches(cfg.model, reader.config, f"HF folder {hf_dir}")
    lacking = missing(reader, hf_names(cfg.model))
    if lacking:
        raise UserError(f"HF folder {hf_dir} lacks {len(lacking)} tensor(s) of the model, e.g. {lacking[:3]}")
    return interop(cfg, registry or _registry()).import_hf(cfg, Path(hf_dir), Path(out))


def export_checkpoint(
    cfg: PrimusConfig,
    checkpoint: str | Path,
    out: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    registry: Registry | None = None,
    verified: bool = False,
) -> Path:
    """The engine checkpoint ``checkpoint`` (a committed checkpoint that verifies, or a folder of them: its newest
    that verifies) -> a HF folder ``out`` that ``from_pretrained`` loads.

    ``registry``: as in :func:`import_checkpoint`. ``verified``: ``checkpoint`` is what
    :func:`primus.core.checkpoints.readable` returned (its files are not read twice)."""
    from primus.core.checkpoints import readable
    from primus.core.hf.config import hf_config
    from primus.core.hf.safetensors_io import write_hf

    # refuses a broken or uncommitted one, naming the file or the folder
    folder = Path(checkpoint) if verified else readable(Path(checkpoint))
    if folder != Path(checkpoint):
        log.info("exporting %s, the newest checkpoint under %s that verifies", folder, checkpoint)
    tensors = interop(cfg, registry or _registry()).export_hf(cfg, folder)
    expected = hf_names(cfg.model)
    if sorted(tensors) != sorted(expected):
        raise RuntimeError(
            f"backend {cfg.backend.name} exported {sorted(set(tensors) ^ set(expected))[:6]} outside the HF contract"
        )
    ordered = {n: tensors[n] for n in expected}
    dtype = str(ordered[EMBED].dtype).removeprefix("torch.")
    tokenizer = tokenizer_source(cfg)
    if tokenizer is None:
        log.info("the run has no tokenizer.json (data.tokenizer %r): exporting weights only", cfg.data.tokenizer)
    return write_hf(out, ordered, hf_config(cfg.model, dtype), max_shard_bytes=max_shard_bytes, tokenizer=tokenizer)
