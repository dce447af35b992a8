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
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from primus.core.config.deepseek import ROUTER_BIAS, attention_names, attention_shapes
from primus.core.config.schema import ParallelConfig
from primus.core.contracts.errors import UserError
from primus.core.contracts.plugins import get_registry
from primus.core.contracts.protocols import load_ref

if TYPE_CHECKING:
    from primus.core.config.schema import ModelConfig, PrimusConfig
    from primus.core.contracts.plugins import Registry
    from primus.core.hf.safetensors_io import HFReader

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
    router, expert = _MOE_NAMES["qwen" if m.family.startswith("qwen") or m.family == "deepseek" else "mixtral"]
    names = {"router": p + router}
    if m.family == "deepseek":
        names["router_bias"] = p + ROUTER_BIAS
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
    if m.mla is not None:
        attention = attention_names(m, p)
    else:
        attention = {r: p + f"self_attn.{r}_proj.weight" for r in "qkvo"}
    names = {
        **attention,
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


# a multi-token-prediction depth's own tensors beside its block's, as DeepSeek-V3's folders name them
MTP_ROLES = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight"}
MTP_ROLES |= {"mtp_norm": "shared_head.norm.weight"}


def mtp_names(m: ModelConfig, k: int) -> dict[str, str]:
    """Role -> HF name of multi-token-prediction depth ``k``'s tensors (``model.mtp``), layer ``num_layers + k`` of a
    DeepSeek-V3 folder: its block's (:func:`layer_names`), the norms of the embedding and of the hidden states
    (``enorm``, ``hnorm``), their projection (``eh_proj``, ``[h, 2h]``: the embedding's half first) and the norm
    before the shared output head. (Folders also hold copies of the embedding and the head there,
    ``embed_tokens`` and ``shared_head.head``: not read, not written.)"""
    i = m.num_layers + k
    return layer_names(m, i) | {role: f"model.layers.{i}.{suffix}" for role, suffix in MTP_ROLES.items()}


def hf_names(m: ModelConfig) -> list[str]:
    """Every tensor name of the HF model (``lm_head`` only when the head is not tied; multi-token prediction's
    last)."""
    names = [EMBED]
    for i in range(m.num_layers):
        names += list(layer_names(m, i).values())
    names.append(FINAL_NORM)
    if not m.tie_word_embeddings:
        names.append(LM_HEAD)
    for k in range(m.mtp.layers if m.mtp is not None else 0):
        names += list(mtp_names(m, k).values())
    return names


SCALED = ("o", "down")  # Megatron's output_layer_init_method: std / sqrt(2 L)


def shapes(m: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, kind) of every tensor; kind is how :mod:`primus.core.run.initial_weights` draws it: ``normal``,
    ``scaled`` (the output projections, :data:`SCALED`), ``ones`` or ``zeros``."""
    h, c, f, v = m.hidden_size, m.kv_channels, m.ffn_hidden_size, m.vocab_size
    q, kv = m.num_attention_heads * c, m.num_kv_heads * c
    role_shape = {
        "q": (q, h),
        "k": (kv, h),
        "v": (kv, h),
        "o": (h, q),
        "gate": (f, h),
        "up": (f, h),
        "down": (h, f),
        "input_norm": (h,),
        "post_norm": (h,),
        "q_bias": (q,),
        "k_bias": (kv,),
        "v_bias": (kv,),
        "q_norm": (c,),
        "k_norm": (c,),
    }
    if m.moe is not None:  # each routed expert is a SwiGLU MLP of its own width; the router maps h to expert logits
        ef = m.moe.expert_ffn_hidden_size
        role_shape |= {"router": (m.moe.num_experts, h), "expert.gate": (ef, h), "expert.up": (ef, h)}
        role_shape |= {"expert.down": (h, ef)}
        sf = m.moe.shared_experts * ef  # the shared experts: one MLP of their summed width
        role_shape |= {"shared.gate": (sf, h), "shared.up": (sf, h), "shared.down": (h, sf)}
        role_shape["router_bias"] = (m.moe.num_experts,)
    if m.mla is not None:  # multi-head latent attention's projections and norms (primus.core.config.deepseek)
        role_shape |= attention_shapes(m)
    role_shape |= {"enorm": (h,), "hnorm": (h,), "eh_proj": (h, 2 * h), "mtp_norm": (h,)}  # multi-token prediction
    mtp = [mtp_names(m, k) for k in range(m.mtp.layers if m.mtp is not None else 0)]
    out = {EMBED: ((v, h), "normal")}
    for names in [layer_names(m, i) for i in range(m.num_layers)] + mtp:
        for role, name in names.items():
            kind = "ones" if role.endswith("norm") else "zeros" if role.endswith("bias") else "normal"
            base = role.rsplit(".", 1)[-1]  # experts.{j}.down -> down
            shape = role_shape["expert." + base] if role.startswith("experts.") else role_shape[role]
            out[name] = (shape, "scaled" if base in SCALED else kind)
    out[FINAL_NORM] = ((h,), "ones")
    if not m.tie_word_embeddings:
        out[LM_HEAD] = ((v, h), "normal")
    return out


class HFInterop(Protocol):
    """What a backend implements (``BackendSpec.hf``). Tensors are exchanged under :func:`hf_names`."""

    def import_hf(self, cfg: PrimusConfig, hf_dir: Path, out: Path) -> Path:
        """Write the weights of the HF folder ``hf_dir`` as this engine's checkpoint under ``out``; returns the
        checkpoint folder a run starts from (``cfg.model`` already describes ``hf_dir``'s architecture)."""
        ...

    def export_hf(self, cfg: PrimusConfig, checkpoint: Path) -> dict[str, Any]:
        """The model weights of this engine's checkpoint ``checkpoint`` as HF-named CPU tensors."""
        ...


class HFAdapterExport(Protocol):
    """An optional method of a backend's :class:`HFInterop` object, for runs with ``train.lora``: a backend that
    trains LoRA adapters offers it, and ``primus checkpoint export`` of a LoRA run's checkpoint refuses (naming the
    backend) where it is missing. (A separate protocol, so that an engine without LoRA still meets
    :class:`HFInterop`.)"""

    def export_adapters(self, cfg: PrimusConfig, checkpoint: Path) -> dict[str, Any]:
        """The trained adapters of the LoRA run's checkpoint ``checkpoint`` (``cfg.train.lora`` set) as fp32 CPU
        tensors, named exactly :func:`primus.core.hf.lora.tensor_names` ``(cfg.model, cfg.train.lora)`` (PEFT's HF
        names without its ``base_model.model.`` prefix). The checkpoint holds the adapters, not the frozen base:
        core writes them as a PEFT folder, and merges them into the base the run names for ``--merge``."""
        ...


def _offline_overrides() -> tuple[str, ...]:
    """A checkpoint is read (and an import written) by one process: every ``parallel`` key back to its default (a
    checkpoint of any layout loads under any other: tp, pp, cp, ep, dp_shard, fsdp ... of the run do not apply), and
    not where its weights came from (the folder of train.init_from may be gone by then)."""
    import json

    reset = [f"parallel.{k}={json.dumps(f.default)}" for k, f in ParallelConfig.model_fields.items()]
    return (*reset, "train.init_from=null")


OFFLINE_OVERRIDES = _offline_overrides()


def _registry() -> Registry:
    """The process's registry, for a top-level call that was handed none."""
    return get_registry()


def interop(cfg: PrimusConfig, registry: Registry) -> HFInterop:
    """The HF importer/exporter of ``cfg.backend.name``; a clear error when the backend has none."""
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


TOKENIZER_DIR = "tokenizer"  # an imported checkpoint's copy of its tokenizer files


def tokenizer_source(cfg: PrimusConfig, checkpoint: Path | None = None) -> Path | None:
    """The tokenizer.json the run used (the bundled one from its cache), or None; for ``checkpoint``, an imported
    one's own copy when ``data.tokenizer`` names a folder no longer there (the checkpoint was moved)."""
    spec = cfg.data.tokenizer
    if checkpoint is not None and spec != "bundled" and not Path(spec).expanduser().exists():
        for folder in (checkpoint, checkpoint.parent):
            if (folder / TOKENIZER_DIR / "tokenizer.json").is_file():
                return folder / TOKENIZER_DIR / "tokenizer.json"
    if spec == "bundled":
        from primus.core.data.tokenizer import bundled_dir, load_tokenizer

        load_tokenizer(spec)  # make sure the cache holds it
        return bundled_dir() / "tokenizer.json"
    path = Path(spec).expanduser()
    path = path / "tokenizer.json" if path.is_dir() else path
    return path if path.is_file() else None


# Tensors a HF folder may hold that transformers itself skips on load: RoPE's inverse frequencies (computed, not
# learned; old Llama checkpoints saved them); and, in unmapped(), a tied model's lm_head (tied over the embedding).
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def unmapped(names: Iterable[str], m: ModelConfig) -> list[str]:
    """The tensors of a HF folder (``names``) that are none of the model's (:func:`hf_names`), sorted; the ones
    ``transformers`` itself ignores are allowed: for DeepSeek-V3, the layers past the model's (multi-token-prediction
    depths a run without ``model.mtp`` leaves unread, and the embedding / head copies those depths carry)."""
    known = set(hf_names(m)) | ({LM_HEAD} if m.tie_word_embeddings else set())

    def past_the_model(n: str) -> bool:
        return m.family == "deepseek" and (i := _LAYER_INDEX.match(n)) is not None and int(i.group(1)) >= m.num_layers

    return sorted(n for n in names if n not in known and not _IGNORED.match(n) and not past_the_model(n))


def tensor_problem(m: ModelConfig, reader: HFReader) -> str | None:
    """Why the tensors of the HF folder of ``reader`` are not those of the model ``m`` (missing ones, or ones Primus
    does not map: a part of the model it would silently drop, e.g. shared experts; the first few and their count),
    or None."""
    from primus.core.hf.safetensors_io import missing

    if lacking := missing(reader, hf_names(m)):
        if m.mtp is not None and set(lacking) <= {n for k in range(m.mtp.layers) for n in mtp_names(m, k).values()}:
            return (
                f"the folder holds no weights of model.mtp's {m.mtp.layers} multi-token-prediction depth(s), e.g. "
                f"{lacking[:2]} (transformers writes num_nextn_predict_layers without them): set model.mtp=null"
            )
        return f"the folder lacks {len(lacking)} tensor(s) of the model, e.g. {lacking[:3]}"
    if extra := unmapped(reader.weight_map, m):
        return (
            f"{len(extra)} tensor(s) of the folder are not part of the model Primus builds from its config.json, "
            f"e.g. {extra[:4]}: refused rather than dropped (Primus maps the tensors of {', '.join(SUPPORTED)})"
        )
    return None


def check_folder(m: ModelConfig, reader: HFReader, where: str) -> None:
    """Refuse to load the HF folder of ``reader`` into the model ``m`` unless every tensor of the one is one of the
    other: another architecture (naming the differing keys), or a :func:`tensor_problem`."""
    from primus.core.hf.config import check_matches
    from primus.core.hf.safetensors_io import HFCheckpointError

    check_matches(m, reader.config, where)
    if problem := tensor_problem(m, reader):
        raise HFCheckpointError(f"{where}: {problem}")


SUPPORTED = ("Llama", "Qwen2", "Qwen3", "Mistral", "Qwen3-MoE", "Mixtral", "DeepSeek-V3")


def import_checkpoint(
    cfg: PrimusConfig, hf_dir: str | Path, out: str | Path, *, registry: Registry | None = None
) -> Path:
    """HF folder -> the checkpoint of ``cfg.backend.name`` under ``out`` (``cfg.model`` must describe it).

    The run's tokenizer (``data.tokenizer``: the folder's own, where ``primus checkpoint import`` took it) goes
    along: its files are copied to ``out/tokenizer``, which the checkpoint's ``config.yaml`` names, so an export or
    a run started from the checkpoint uses the tokenizer of its embedding.

    ``registry``: the installed plugins' (the CLI's); the process's own when not given."""
    from primus.core.hf.safetensors_io import HFReader, copy_tokenizer

    check_folder(cfg.model, HFReader(hf_dir), f"HF folder {hf_dir}")
    out = Path(out)
    tokenizer = None if cfg.data.tokenizer == "bundled" else tokenizer_source(cfg)
    if tokenizer is not None:
        data = cfg.data.model_copy(update={"tokenizer": str((out / TOKENIZER_DIR).absolute())})
        cfg = cfg.model_copy(update={"data": data})
    path = interop(cfg, registry or _registry()).import_hf(cfg, Path(hf_dir), out)
    if tokenizer is not None and int(os.environ.get("RANK", "0")) == 0:  # after the engine: a save replaces out
        copy_tokenizer(tokenizer, out / TOKENIZER_DIR)
    return path


def export_checkpoint(
    cfg: PrimusConfig,
    folder: str | Path,
    out: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    registry: Registry | None = None,
) -> Path:
    """The engine checkpoint ``folder`` -> a HF folder ``out`` that ``from_pretrained`` loads. ``folder`` is one the
    caller has verified (:func:`primus.core.run.checkpoints.readable` returns it for a checkpoint or a folder of
    them; the run room sits above this one). ``registry``: as in :func:`import_checkpoint`.

    A LoRA run's checkpoint (``train.lora``) holds adapters, not the model: see :mod:`primus.core.launch.export`
    (``primus checkpoint export`` takes it there)."""
    from primus.core.hf.config import hf_config
    from primus.core.hf.safetensors_io import write_hf

    folder = Path(folder)
    registry = registry or _registry()
    if cfg.train.lora is not None:
        raise UserError(
            f"{folder} is a LoRA run's checkpoint (train.lora): its adapters export with primus.core.launch.export"
        )
    ordered = full_weights(cfg, folder, registry)
    dtype = str(ordered[EMBED].dtype).removeprefix("torch.")
    return write_hf(
        out,
        ordered,
        hf_config(cfg.model, dtype),
        max_shard_bytes=max_shard_bytes,
        tokenizer=export_tokenizer(cfg, folder),
    )


def full_weights(cfg: PrimusConfig, folder: Path, registry: Registry) -> dict[str, Any]:
    """The model weights of the (not LoRA) checkpoint ``folder``, HF-named, in :func:`hf_names` order."""
    tensors = interop(cfg, registry).export_hf(cfg, folder)
    expected = hf_names(cfg.model)
    if sorted(tensors) != sorted(expected):
        raise RuntimeError(
            f"backend {cfg.backend.name} exported {sorted(set(tensors) ^ set(expected))[:6]} outside the HF contract"
        )
    return {n: tensors[n] for n in expected}


def export_tokenizer(cfg: PrimusConfig, folder: Path) -> Path | None:
    """The run's tokenizer.json to copy into an export, or None (none, or not the model's)."""
    tokenizer = tokenizer_source(cfg, folder)
    if tokenizer is None:
        log.info("the run has no tokenizer.json (data.tokenizer %r): exporting weights only", cfg.data.tokenizer)
    elif (size := _vocab_size(tokenizer)) > cfg.model.vocab_size:
        log.warning(
            "the run's tokenizer %s has %d tokens, more than the model's %d embedding rows: it is not the model's, "
            "exporting weights only",
            tokenizer,
            size,
            cfg.model.vocab_size,
        )
        tokenizer = None
    return tokenizer


def _vocab_size(tokenizer_json: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
