"""Hugging Face <-> megatron-core GPTModel built with :mod:`primus.megatron.layer_spec`.

Layout (the local spec: norms are their own modules, not fused into the linears):

- ``self_attention.linear_qkv`` is q, k and v fused along the output dim, grouped per KV head:
  ``[group 0: its q heads, k, v | group 1: ... ]`` (the same for the qkv bias);
- ``mlp.linear_fc1`` is ``[gate; up]`` (megatron's SwiGLU halves: gate first);
- a mixture-of-experts layer has ``mlp.router`` (HF's ``mlp.gate``) and, per routed expert,
  ``mlp.experts.experts.linear_fc1`` ``[gate; up]`` and ``linear_fc2`` (SequentialMLP's local MLPs, or slices of
  StackedExperts' two parameters under the same sharded keys; in the sharded
  state dict a model with experts has one key per layer, ``decoder.layers.{i}.…``, the expert its prepended axis);
- ``input_layernorm``, ``pre_mlp_layernorm``, ``q_layernorm`` / ``k_layernorm`` (per head),
  ``decoder.final_layernorm``, ``embedding.word_embeddings``, ``output_layer`` (absent when tied).

Megatron's RoPE is rotate-half, as HF's: q and k need no permutation.

Layout across ranks is megatron's own: each rank's ``sharded_state_dict()`` says which slice of which global
tensor (key, layer offset, TP offset; the SwiGLU factory splits fc1 into its gate and up parts) each local
tensor is, so the same code fills a TP/PP-sharded model from HF tensors and reads the whole model back out.
Checkpoints are ``dist_checkpointing`` folders, loadable under any layout.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from primus.core.config.schema import ModelConfig, PrimusConfig
from primus.core.hf.contract import EMBED, FINAL_NORM, LM_HEAD, expert_role, layer_names, mtp_names
from primus.megatron.lora import MARK as LORA_MARK

log = logging.getLogger("primus.megatron.hf")

_LAYER = "decoder.layers."
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")  # a per-layer key (models with experts)
# multi-token prediction depth k (megatron's MultiTokenPredictionBlock): its block's tensors are a decoder layer's
# (layer num_layers + k), its own are core's MTP roles (primus.core.hf.contract.MTP_ROLES)
_MTP_KEY = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP = "mtp."
_MTP_ROLES = {"enorm.weight": "enorm", "hnorm.weight": "hnorm", "eh_proj.weight": "eh_proj"}
_MTP_ROLES |= {"final_layernorm.weight": "mtp_norm"}


def _mtp_name(key: str, layer: int, m: ModelConfig) -> str:
    """The HF name of a multi-token-prediction depth's own tensor ``mtp.<name>`` (its layer: ``num_layers + k``)."""
    return mtp_names(m, layer - m.num_layers)[_MTP_ROLES[key.removeprefix(_MTP)]]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """HF q [nq·d, ...], k/v [ng·d, ...] -> megatron's grouped ``[q heads of g, k_g, v_g]`` per KV group."""
    ng, d = m.num_kv_heads, m.kv_channels
    rest = q.shape[1:]
    parts = (q.reshape(ng, -1, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, m: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, d = m.num_kv_heads, m.kv_channels
    qd = m.num_attention_heads // ng * d
    rest = fused.shape[1:]
    grouped = fused.reshape(ng, qd + 2 * d, *rest)
    q, k, v = grouped.split([qd, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# megatron layer key suffix -> (HF roles it is made of)
_LAYER_ROLES = {
    "input_layernorm.weight": ("input_norm",),
    "pre_mlp_layernorm.weight": ("post_norm",),
    "self_attention.linear_qkv.weight": ("q", "k", "v"),
    "self_attention.linear_qkv.bias": ("q_bias", "k_bias", "v_bias"),
    "self_attention.linear_proj.weight": ("o",),
    "self_attention.q_layernorm.weight": ("q_norm",),
    "self_attention.k_layernorm.weight": ("k_norm",),
    "mlp.linear_fc1.weight": ("gate", "up"),
    "mlp.linear_fc2.weight": ("down",),
    "mlp.router.weight": ("router",),
    "mlp.shared_experts.linear_fc1.weight": ("shared.gate", "shared.up"),
    "mlp.shared_experts.linear_fc2.weight": ("shared.down",),
}
# loss-free balancing's routing bias: training state with no HF tensor (Qwen3-MoE and Mixtral have none): left at
# megatron's zeros on import, not exported
_NOT_IN_HF = frozenset({"mlp.router.expert_bias"})
# megatron expert key suffix -> (the expert's HF roles it is made of)
_EXPERT_ROLES = {
    "mlp.experts.experts.linear_fc1.weight": ("gate", "up"),
    "mlp.experts.experts.linear_fc2.weight": ("down",),
}
# multi-head latent attention (megatron's MLASelfAttention, local spec: its two latent norms are modules) and
# DeepSeek's routing bias, which DeepseekV3ForCausalLM folders hold (mlp.gate.e_score_correction_bias)
_DEEPSEEK_ROLES = {
    "self_attention.linear_q_proj.weight": ("q",),
    "self_attention.linear_q_down_proj.weight": ("q_a",),
    "self_attention.q_layernorm.weight": ("q_a_norm",),
    "self_attention.linear_q_up_proj.weight": ("q_b",),
    "self_attention.linear_kv_down_proj.weight": ("kv_a",),
    "self_attention.kv_layernorm.weight": ("kv_a_norm",),
    "self_attention.linear_kv_up_proj.weight": ("kv_b",),
    "mlp.router.expert_bias": ("router_bias",),
}
_GLOBAL = {"embedding.word_embeddings.weight": EMBED, "decoder.final_layernorm.weight": FINAL_NORM}


def _layer_roles(m: ModelConfig) -> dict[str, tuple[str, ...]]:
    return _LAYER_ROLES | _DEEPSEEK_ROLES if m.family == "deepseek" else _LAYER_ROLES


def _skipped(suffix: str, m: ModelConfig) -> bool:
    """Model state with no HF tensor in this family, or a LoRA adapter (not the base model's: :mod:`.lora`)."""
    return (suffix in _NOT_IN_HF and m.family != "deepseek") or LORA_MARK in suffix


def _roles(suffix: str, expert: int | None, m: ModelConfig) -> tuple[str, ...]:
    if expert is None:
        return _layer_roles(m)[suffix]
    return tuple(expert_role(expert, r) for r in _EXPERT_ROLES[suffix])


def megatron_tensor(
    key: str, layer: int | None, get: Callable[[str], torch.Tensor], m: ModelConfig, expert: int | None = None
) -> torch.Tensor:
    """The whole (unsharded) megatron tensor ``key`` (of ``layer``, for layer keys; of routed ``expert``, for
    expert keys) from HF tensors."""
    if key in _GLOBAL:
        return get(_GLOBAL[key])
    if key == "output_layer.weight":
        return get(EMBED if m.tie_word_embeddings else LM_HEAD)
    if key.startswith(_MTP):
        return get(_mtp_name(key, layer, m))
    suffix = key.removeprefix(_LAYER)
    if suffix not in (_EXPERT_ROLES if expert is not None else _layer_roles(m)) or layer is None:
        raise KeyError(f"no HF counterpart of megatron tensor {key!r}")
    names = layer_names(m, layer)
    parts = [get(names[role]) for role in _roles(suffix, expert, m)]
    if len(parts) == 3:
        return fuse_qkv(*parts, m)
    return torch.cat(parts, dim=0) if len(parts) == 2 else parts[0]


def hf_tensors(
    key: str, layer: int | None, full: torch.Tensor, m: ModelConfig, expert: int | None = None
) -> dict[str, torch.Tensor]:
    """The HF tensors a whole megatron tensor holds (the inverse of :func:`megatron_tensor`)."""
    if key in _GLOBAL:
        return {_GLOBAL[key]: full}
    if key == "output_layer.weight":
        return {} if m.tie_word_embeddings else {LM_HEAD: full}
    if key.startswith(_MTP):
        return {_mtp_name(key, layer, m): full.clone()}
    suffix = key.removeprefix(_LAYER)
    names = layer_names(m, layer)
    roles = _roles(suffix, expert, m)
    if len(roles) == 3:
        parts = split_qkv(full, m)
    elif len(roles) == 2:
        parts = full.chunk(2, dim=0)
    else:
        parts = (full,)
    return {names[r]: p.clone() for r, p in zip(roles, parts, strict=True)}


def _sharded_tensors(chunk: Any) -> Iterator[Any]:
    """Every ShardedTensor of a chunk's sharded state dict (SwiGLU factories built into their halves);
    their ``data`` are views of the chunk's parameters."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from primus.megatron.checkpoint import chunk_sharded_state_dict

    def walk(obj: Any) -> Iterator[Any]:
        if isinstance(obj, ShardedTensor):
            yield obj
        elif isinstance(obj, ShardedTensorFactory):
            built = obj.build()
            yield from walk(list(nested_values(built)) if isinstance(built, dict) else built)
        elif isinstance(obj, list | tuple):
            for item in obj:
                yield from walk(item)

    for value in nested_values(chunk_sharded_state_dict(chunk)):
        yield from walk(value)


def _place(st: Any, m: ModelConfig) -> tuple[str, int | None, int | None, tuple[slice, ...]]:
    """(key without a layer number, global layer, global expert, slices of the whole per-layer / per-expert tensor)
    that a ShardedTensor's local data covers. Its prepended axes are the layer's (unless the key names the layer)
    and then the expert's. A multi-token-prediction depth k is layer ``num_layers + k``: its block's keys become a
    decoder layer's, its own ``mtp.<name>``."""
    n = st.prepend_axis_num
    axes = [int(o) for o in st.global_offset[:n]]
    key, layer = st.key, None
    if match := _MTP_KEY.match(key):
        rest, layer = match.group(2), m.num_layers + int(match.group(1))
        inner = rest.removeprefix("transformer_layer.")
        key = _LAYER + inner if inner != rest else _MTP + rest
    elif match := _LAYER_KEY.match(key):
        key, layer = _LAYER + match.group(2), int(match.group(1))
    elif axes:
        layer = axes.pop(0)
    expert = axes.pop(0) if axes else None
    where = tuple(slice(o, o + s) for o, s in zip(st.global_offset[n:], st.data.shape, strict=True))
    return key, layer, expert, where


@torch.no_grad()
def fill_from_hf(chunks: list[Any], get: Callable[[str], torch.Tensor], m: ModelConfig) -> int:
    """Copy HF weights into this rank's model chunks (any TP/PP/VPP layout); returns tensors filled."""
    cache: dict[tuple[str, int | None, int | None], torch.Tensor] = {}
    filled = 0
    for chunk in chunks:
        for st in _sharded_tensors(chunk):
            key, layer, expert, where = _place(st, m)
            if _skipped(key.removeprefix(_LAYER), m):
                continue
            if (key, layer, expert) not in cache:
                cache[(key, layer, expert)] = megatron_tensor(key, layer, get, m, expert)
            full = cache[(key, layer, expert)]
            if full.dim() != len(where):
                raise ValueError(f"{st.key}: HF gives shape {tuple(full.shape)}, megatron slices {where}")
            st.data.copy_(full[where].to(st.data.dtype))
            filled += 1
    return filled


@torch.no_grad()
def gather_to_hf(chunks: list[Any], m: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole model as HF tensors, from chunks that hold all of it (one rank, tp = pp = 1)."""
    whole: dict[tuple[str, int | None, int | None], torch.Tensor] = {}
    for chunk in chunks:
        for st in _sharded_tensors(chunk):
            key, layer, expert, where = _place(st, m)
            if _skipped(key.removeprefix(_LAYER), m):
                continue
            shape = st.global_shape[st.prepend_axis_num :]
            buf = whole.setdefault((key, layer, expert), torch.zeros(shape, dtype=st.data.dtype))
            buf[where] = st.data.detach().cpu()
    out: dict[str, torch.Tensor] = {}
    for (key, layer, expert), full in whole.items():
        out.update(hf_tensors(key, layer, full, m, expert))
    return out


# ------------------------------------------------------------------------------------------------ engine setup


class _Engine:
    """Process group + megatron parallel state + this rank's chunks, for import / export / tests."""

    def __init__(self, cfg: PrimusConfig, single: bool, registry: Any = None):
        """``registry``: the caller's (kernel providers); the process's own only when none is handed in."""
        from primus.core.kernels.selection import detect_device, select_kernels
        from primus.megatron.dist import init_distributed, init_parallel, seed
        from primus.megatron.model import build_chunks, transformer_config

        self.rank, world, _ = init_distributed(timedelta(minutes=10))
        if single or world == 1:  # a dist checkpoint loads under any layout: one process builds the whole model
            one = {"tp": 1, "pp": 1, "vpp": 1, "cp": 1, "ep": 1, "sequence_parallel": False}
            cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update=one)})
        self.cfg = cfg
        p = cfg.parallel
        init_parallel(p.tp, p.pp, p.vpp, p.cp, ep=p.ep)
        seed(cfg.train.seed)
        if registry is None:
            from primus.core.contracts.plugins import get_registry

            registry = get_registry()
        kernels = select_kernels(
            type(cfg.kernels)(), registry, detect_device(), head_dim=cfg.model.kv_channels, dtype="fp32"
        )
        self.chunks = build_chunks(cfg, transformer_config(cfg), kernels)
        self.layout = {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "world": world}

    def close(self) -> None:
        from primus.megatron.dist import teardown

        teardown()


def init_canonical(chunks: list[Any], cfg: PrimusConfig) -> None:
    """``train.init: canonical``: core's initial tensors (:mod:`primus.core.run.initial_weights`, by HF name), into this rank's
    TP/PP shards, so every layout, and the TorchTitan backend, starts from the same weights."""
    from primus.core.run import initial_weights as init

    n = fill_from_hf(chunks, lambda name: init.tensor(name, cfg.model, cfg.train.seed), cfg.model)
    log.info("initialised %d tensors from train.seed %d (canonical init)", n, cfg.train.seed)


def load_init_from(chunks: list[Any], cfg: PrimusConfig) -> None:
    """``train.init_from``: this rank's chunks take the weights of a HF folder (checked to match the model) or of
    a megatron checkpoint of any layout (its model part; core converts another engine's to a HF folder first)."""
    from primus.core.hf.contract import check_folder
    from primus.core.hf.safetensors_io import HFReader
    from primus.core.run.init_from import source
    from primus.megatron import checkpoint as ckpt

    src = source(cfg.train.init_from)
    if src.kind == "checkpoint":
        ckpt.load_seed(src.path, chunks, cfg)
        return
    reader = HFReader(src.path)
    check_folder(cfg.model, reader, f"train.init_from {src.path}")
    n = fill_from_hf(chunks, reader.get, cfg.model)
    log.info("initialised %d tensors from Hugging Face weights in %s", n, src.path)


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder (``step_N`` or a seed/imported one), or a checkpoints root (its newest complete one)."""
    from primus.core.contracts.errors import UserError
    from primus.megatron import checkpoint as ckpt

    if ckpt.read_manifest(path) is not None:
        return path
    found = ckpt.latest(path)
    if found is None:
        raise UserError(f"{path} is neither a primus-megatron checkpoint (no manifest.json) nor a folder holding one")
    return found[1]


def load_checkpoint_chunks(cfg: PrimusConfig, checkpoint: Path) -> _Engine:
    """One process, the whole model, loaded from a dist checkpoint (model part only) of any layout."""
    from primus.megatron import checkpoint as ckpt

    path = resolve_checkpoint(checkpoint)
    engine = _Engine(cfg, single=True)
    ckpt.load_seed(path, engine.chunks, engine.cfg)  # the model part, checked against the config
    return engine


class MegatronHF:
    """``BackendSpec.hf`` of the megatron backend (:class:`primus.core.hf.contract.HFInterop`)."""

    def import_hf(self, cfg: PrimusConfig, hf_dir: Path, out: Path) -> Path:
        """A seed checkpoint (model only, step 0) at ``out``: start a run from it with
        ``train.init_from=OUT``. One process builds the whole model; under torchrun with the
        config's world size each rank fills its TP/PP shard."""
        import yaml

        from primus.core.hf.safetensors_io import HFReader
        from primus.core.run.checkpoints import weights_only
        from primus.megatron import checkpoint as ckpt

        engine = _Engine(cfg, single=False)
        try:
            n = fill_from_hf(engine.chunks, HFReader(hf_dir).get, engine.cfg.model)
            log.info("filled %d tensors from %s (layout %s)", n, hf_dir, engine.layout)
            man = {**ckpt.manifest(engine.cfg, 0, engine.layout), "weights_only": weights_only(cfg, str(hf_dir))}
            ckpt.save_seed(out, engine.chunks, engine.rank, man)
            if engine.rank == 0:
                (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        finally:
            engine.close()
        return out

    def export_hf(self, cfg: PrimusConfig, checkpoint: Path) -> dict[str, Any]:
        engine = load_checkpoint_chunks(cfg, checkpoint)
        try:
            return gather_to_hf(engine.chunks, engine.cfg.model)
        finally:
            engine.close()

    def export_adapters(self, cfg: PrimusConfig, checkpoint: Path) -> dict[str, torch.Tensor]:
        """The LoRA adapters of a ``train.lora`` run's checkpoint (any layout), HF name -> fp32 CPU tensor: exactly
        :func:`primus.core.hf.lora.tensor_names` (one process builds the model and reads the adapters alone)."""
        from megatron.core import dist_checkpointing

        from primus.core.contracts.errors import UserError
        from primus.megatron import checkpoint as ckpt
        from primus.megatron.lora import attach, hf_adapters

        if cfg.train.lora is None:
            raise UserError(f"train.lora is not set: {checkpoint} holds no adapters to export")
        path = resolve_checkpoint(checkpoint)
        ckpt.check_compatible(path, cfg)
        engine = _Engine(cfg, single=True)
        try:
            attach(engine.chunks, engine.cfg, initialise=False)  # zeros, then the checkpoint's values
            sd = {f"chunk{i}": ckpt.model_sharded_state_dict(c) for i, c in enumerate(engine.chunks)}
            state = dist_checkpointing.load({"model": sd}, str(path))
            for i, chunk in enumerate(engine.chunks):
                ckpt.load_model_state(chunk, state["model"][f"chunk{i}"])
            return hf_adapters(engine.chunks, engine.cfg)
        finally:
            engine.close()


INTEROP = MegatronHF()
