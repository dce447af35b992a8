"""Megatron-LM's own checkpoints, recognised for ``primus checkpoint import --from`` (``BackendSpec.native``,
:mod:`primus.core.contracts.native`): what ``megatron/training/checkpointing.py:save_checkpoint`` writes with
``--ckpt-format torch_dist`` (its default; AMD's Primus on Megatron-LM writes the same).

A save folder holds ``latest_checkpointed_iteration.txt`` (the newest iteration, or ``release``) and one folder per
saved iteration, ``iter_NNNNNNN`` (``release``). Each is a megatron-core ``dist_checkpointing`` checkpoint:
``metadata.json`` (``sharded_backend: torch_dist``, written last), the common state (what is not a tensor:
``args``, the argparse namespace of the run, ``iteration``, ``checkpoint_version`` 3.0, the optimizer's param
groups, ``opt_param_scheduler``, ``content_metadata``: how the state dicts were sharded; ``common.pt`` from
megatron-core 0.16, one ``common_state`` object in the DCP files from 0.17), and the tensors in
torch DCP's ``.metadata`` + ``__R_N.distcp``: global tensors whatever TP / PP / EP / VPP saved them, under the keys of
the model's sharded state dict (``decoder.layers.self_attention.linear_qkv.weight``, ...) and the optimizer's
(``optimizer.state.exp_avg.<model key>`` where it holds per-parameter state). The legacy ``--ckpt-format torch``
(``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt``, one file per model-parallel rank) is recognised and refused.

This module reads file names, ``metadata.json``, the common state (small: the arguments) and the DCP ``.metadata`` index,
with torch but no megatron import; the engine loads what it recognised (:mod:`primus.megatron.native_load`).
The model is what Megatron-LM's arguments say (:func:`model_fields`); a feature Primus's megatron engine does not
build is named in the refusal.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

from primus.core.contracts.native import NativeCheckpoint

SOURCE = "Megatron-LM"
TRACKER = "latest_checkpointed_iteration.txt"
ITER = re.compile(r"^iter_(\d{7,})$")
RELEASE = "release"
LEGACY = re.compile(r"^mp_rank_\d\d(_\d\d\d)?(_\d\d\d)?$")
EXPECTS = (
    "a Megatron-LM torch_dist checkpoint (its save folder with latest_checkpointed_iteration.txt and "
    "iter_NNNNNNN/ folders, or one iter_NNNNNNN/ folder: metadata.json, .metadata, *.distcp, and common.pt before "
    "megatron-core 0.17)"
)
#: a model tensor's optimizer state in model space: ``[chained_<i>.]optimizer.state.<kind>.<model key>``
STATE_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(exp_avg|exp_avg_sq|param|fp32_param)\.(.+)$")


class _Opaque:
    """Stands in, while the common state is read, for a class of a package this module does not import (megatron's enums
    and configs in ``args``): built and filled like the original, never called."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Unpickler(pickle.Unpickler):
    _TRUSTED = ("builtins", "collections", "argparse", "copyreg", "_codecs", "pathlib", "types", "datetime", "torch",
                "numpy", "enum", "functools", "io")  # fmt: skip

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] in self._TRUSTED:
            return super().find_class(module, name)
        return type(name, (_Opaque,), {"__module__": module})


class _pickle:  # the pickle module torch.load is handed: its own Unpickler, no megatron import
    Unpickler = _Unpickler
    load = pickle.load


#: where megatron-core from 0.17 (0.19.2 here) keeps the common state of a torch_dist checkpoint: one object
#: (``ShardedObject("common_state")``) among the tensors of the DCP files, instead of ``common.pt``
COMMON_STATE = "common_state/shard_0_1"


def has_common(folder: Path) -> bool:
    """Whether ``folder`` holds a torch_dist common state: ``common.pt`` (megatron-core 0.16) or the ``common_state``
    object of its DCP index (0.19)."""
    if (folder / "common.pt").is_file():
        return True
    if not (folder / ".metadata").is_file():
        return False
    from torch.distributed.checkpoint import FileSystemReader

    return COMMON_STATE in FileSystemReader(str(folder)).read_metadata().state_dict_metadata


def read_common(folder: Path) -> dict[str, Any]:
    """The common state of a torch_dist checkpoint: Megatron-LM's ``args`` namespace and the other non-tensor state,
    from ``common.pt`` (written by megatron-core 0.16) or else the ``common_state`` object of the DCP files (0.19).
    Read with ``weights_only=False``: the namespace (and the classes in it) is not a tensor file torch's safe loader
    accepts; it is the user's own checkpoint, the same trust ``megatron.training`` gives it on load. Classes outside
    the standard library, torch and numpy (megatron's enums and configs) load as inert stand-ins, so reading it
    imports no megatron."""
    import io

    import torch

    if (folder / "common.pt").is_file():
        return torch.load(folder / "common.pt", map_location="cpu", weights_only=False, pickle_module=_pickle)
    data = io.BytesIO(_dcp_bytes(folder, COMMON_STATE))
    # megatron saves the object's data in a one-item list
    return torch.load(data, map_location="cpu", weights_only=False, pickle_module=_pickle)[0]


def _dcp_bytes(folder: Path, key: str) -> bytes:
    """A bytes item of the DCP files in ``folder``, as written: DCP's default planner would unpickle it itself
    (``torch.load(weights_only=False)``, importing whatever classes it names), not with this module's unpickler.
    Read by this process alone, whatever process group it is in."""
    import io
    import warnings

    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    found: dict[str, bytes] = {}

    class Raw(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            found[read_item.dest_index.fqn] = value.read()

    with warnings.catch_warnings():  # DCP's notice that no_dist loads in one process: the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load({key: io.BytesIO()}, storage_reader=FileSystemReader(str(folder)), planner=Raw(), no_dist=True)
    return found[key]


def tensor_index(folder: Path) -> dict[str, tuple[int, ...]]:
    """The tensors of a torch_dist checkpoint (DCP's ``.metadata``): key -> global shape (its non-tensor entries,
    megatron's ShardedObjects such as ``_extra_state`` and ``rng_state``, left out)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {key: tuple(meta.size) for key, meta in metadata.items() if hasattr(meta, "size")}


def optimizer_state(index: dict[str, tuple[int, ...]], common: dict[str, Any]) -> tuple[str | None, str | None]:
    """(how the checkpoint holds optimizer state, why it cannot be carried over or None); ``None, None``: it holds
    none. Megatron's regular optimizer saves per model tensor (``optimizer.state.exp_avg.<model key>``), and so does
    the distributed optimizer's ``fully_reshardable``: any layout reads them. The distributed optimizer's
    ``dp_reshardable`` (Megatron-LM's default) and ``dp_zero_gather_scatter`` follow the saving run's gradient
    buckets, which megatron-core 0.16 reads back only at the TP × PP × EP they were saved at
    (``DistributedOptimizer.checkpoint_fully_reshardable_formats``); ``fully_sharded_model_space`` (written before
    megatron-core 0.13) is flattened per-rank slices, which 0.16 no longer reads (``flattened_range is not
    supported``)."""
    if not any(k.startswith(("optimizer.", "chained_")) for k in index) and common.get("optimizer") is None:
        return None, None
    args = common.get("args")
    kind = getattr(args, "optimizer", None) or "adam"
    moments = {m[1] for k in index if (m := STATE_KEY.match(k))} >= {"exp_avg", "exp_avg_sq"}
    not_adam = f"its optimizer is {kind} (Primus carries Adam's moments over): the weights alone are imported"
    if not getattr(args, "use_distributed_optimizer", False):
        holds = "megatron's regular optimizer's"
        if kind != "adam":
            return holds, not_adam
        return holds, None if moments else "it holds no Adam moments per model tensor: the weights alone are imported"
    sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if sharding is None:  # megatron-core < 0.13 recorded none; Megatron-LM then assumes as here
        sharding = (
            "fully_sharded_model_space"
            if getattr(args, "ckpt_fully_parallel_save", False)
            else "dp_zero_gather_scatter"
        )
    holds = f"the distributed optimizer's, {sharding}"
    if kind != "adam":
        return holds, not_adam
    if sharding == "fully_reshardable" and moments:
        return holds, None
    if sharding == "fully_sharded_model_space":
        why = (
            "is in flattened per-rank slices (fully_sharded_model_space, megatron-core < 0.13), which megatron-core "
            "0.16 no longer reads"
        )
    else:
        default = ", Megatron-LM's default" if sharding == "dp_reshardable" else ""
        why = (
            f"({sharding}{default}) follows the saving run's gradient buckets, which megatron-core reads back only at "
            "the layout it was saved at"
        )
    return holds, (
        f"its distributed-optimizer state {why}: the weights alone are imported (to carry the optimizer state over, "
        "save it with --dist-ckpt-optim-fully-reshardable)"
    )


def adam_step(common: dict[str, Any]) -> float | None:
    """The optimizer's update count from the common state: the distributed optimizer's param groups' ``step``, the
    regular optimizer's ``common_step`` (None: not recorded)."""
    found: list[float] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("step", "common_step") and not isinstance(v, (dict, list, tuple)) and v is not None:
                    found.append(float(v))
                else:
                    walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(common.get("optimizer"))
    return max(found) if found else None


# --- Megatron-LM's arguments -> Primus's model config --------------------------------------------------------------

#: arguments whose value Primus's megatron engine must see to build the same model: (name, allowed values, what)
_REFUSED = (
    ("use_legacy_models", (False, None), "the legacy Megatron model classes (--use-legacy-models)"),
    ("normalization", ("RMSNorm",), "--normalization (Primus's models use RMSNorm)"),
    ("apply_layernorm_1p", (False, None), "--apply-layernorm-1p"),
    ("add_bias_linear", (False,), "biases on the linear layers (Megatron-LM's default; --disable-bias-linear)"),
    ("swiglu", (True,), "an MLP other than SwiGLU (--swiglu)"),
    ("squared_relu", (False, None), "--squared-relu"),
    ("quick_geglu", (False, None), "--quick-geglu"),
    ("rotary_percent", (1.0, None), "--rotary-percent below 1"),
    ("rotary_interleaved", (False, None), "--rotary-interleaved"),
    ("window_size", (None,), "sliding-window attention (--window-size)"),
    ("no_rope_freq", (None,), "layers without RoPE (--no-rope-freq)"),
    ("qk_l2_norm", (False, None), "--qk-l2-norm"),
    ("heterogeneous_layers_config_path", (None,), "heterogeneous layers"),
    ("hybrid_override_pattern", (None,), "a hybrid (Mamba) model"),
    ("is_hybrid_model", (False, None), "a hybrid (Mamba) model"),
    ("attention_output_gate", (False, None), "--attention-output-gate"),
    ("softmax_type", ("vanilla", None), "--softmax-type other than vanilla"),
    ("moe_shared_expert_gate", (False, None), "a gated shared expert"),
    ("moe_latent_size", (None,), "--moe-latent-size"),
)
_BALANCING = {"aux_loss", "seq_aux_loss", "none"}
# MLATransformerConfig's defaults (megatron-core 0.16), which a run that did not pass these arguments used
_MLA_YARN = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
             "mscale_all_dim": 0.0}  # fmt: skip


class _Args:
    def __init__(self, ns: Any) -> None:
        self.ns = ns

    def __call__(self, *names: str, default: Any = None) -> Any:
        for name in names:
            value = getattr(self.ns, name, None)
            if value is not None:
                return value
        return default


def model_fields(ns: Any, embedding_rows: int | None, name: str) -> tuple[dict[str, Any], list[str]]:
    """Primus ``model`` fields of the model Megatron-LM's arguments ``ns`` describe (the embedding's rows: the padded
    vocabulary), and what of it Primus's megatron engine does not build (one phrase each; none: it builds it)."""
    a = _Args(ns)
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if a(k) is None]
    if missing:
        return {}, [f"a model without {', '.join(missing)} in its arguments"]
    problems = []
    mla = bool(a("multi_latent_attention", default=False))
    for key, allowed, what in _REFUSED:
        value = getattr(ns, key, None)
        if value not in allowed:
            problems.append(f"{what}: {key} {value!r}")
    position = a("position_embedding_type", default="learned_absolute")
    if position not in (("rope", "none") if mla else ("rope",)):
        problems.append(f"--position-embedding-type {position} (Primus's models use RoPE)")
    heads = int(a("num_attention_heads"))
    hidden = int(a("hidden_size"))
    kv = int(a("num_query_groups")) if a("group_query_attention", default=False) else heads
    head_dim = a("kv_channels")
    vocab = int(embedding_rows or a("padded_vocab_size", "vocab_size"))
    fields: dict[str, Any] = {
        "name": name,
        "hidden_size": hidden,
        "num_layers": int(a("num_layers")),
        "num_attention_heads": heads,
        "num_kv_heads": heads if mla else kv,
        "head_dim": int(head_dim) if head_dim and int(head_dim) != hidden // heads and not mla else None,
        "ffn_hidden_size": int(a("ffn_hidden_size", default=4 * hidden)),
        "vocab_size": vocab,
        "max_position_embeddings": int(a("max_position_embeddings", "seq_length")),
        "rope_theta": float(a("rotary_base", default=10000)),
        "rope_scaling": _rope_scaling(a, mla, problems),
        "norm_eps": float(a("layernorm_epsilon", "norm_epsilon", default=1e-5)),
        "tie_word_embeddings": not a("untie_embeddings_and_output_weights", default=False),
        "qkv_bias": bool(a("add_qkv_bias", default=False)),
        "qk_norm": bool(a("qk_layernorm", default=False)) and not mla,
        "init_std": float(a("init_method_std", default=0.02)),
        "moe": _moe(a, problems),
        "mla": None,
        "mtp": None,
    }
    if mla:
        if not a("qk_layernorm", default=False):
            problems.append("multi-head latent attention without its latent norms (--qk-layernorm)")
        fields["mla"] = {
            "q_lora_rank": a("q_lora_rank"),
            "kv_lora_rank": int(a("kv_lora_rank", default=512)),
            "qk_nope_head_dim": int(a("qk_head_dim", default=128)),
            "qk_rope_head_dim": int(a("qk_pos_emb_head_dim", default=64)),
            "v_head_dim": int(a("v_head_dim", default=128)),
        }
    if a("mtp_num_layers"):
        fields["mtp"] = {
            "layers": int(a("mtp_num_layers")),
            "loss_scale": float(a("mtp_loss_scaling_factor", default=0.1)),
        }
    fields["family"] = family(fields)
    return fields, problems


def family(m: dict[str, Any]) -> str:
    """The Primus family the features say (as :func:`primus.core.hf.config.model_fields_from_hf` tells HF's apart):
    latent attention DeepSeek, per-head q/k norms Qwen3 (Qwen3-MoE with experts), q/k/v biases Qwen2, experts
    otherwise Mixtral-style (mistral), else Llama."""
    if m["mla"] is not None:
        return "deepseek"
    if m["qk_norm"]:
        return "qwen3"
    if m["qkv_bias"]:
        return "qwen2"
    return "mistral" if m["moe"] is not None else "llama"


def _rope_scaling(a: _Args, mla: bool, problems: list[str]) -> dict[str, Any] | None:
    if mla:  # megatron's MLA owns its RoPE: YaRN unless --rope-type rope (YaRN at factor 1 is plain RoPE)
        factor = float(a("rotary_scaling_factor", default=1.0))
        if a("rope_type", default="yarn") != "yarn" or factor == 1.0:
            return None
        out = {k: a(k, default=v) for k, v in _MLA_YARN.items()}
        return {"type": "yarn", "factor": factor, **out}
    if a("use_rope_scaling", default=False):  # megatron's llama3 scaling: low 1, high 4, original 8192 (Primus's too)
        return {"type": "llama3", "factor": float(a("rope_scaling_factor", default=8.0))}
    if a("rotary_seq_len_interpolation_factor"):
        return {"type": "linear", "factor": float(a("rotary_seq_len_interpolation_factor"))}
    if a("rope_type", default="rope") != "rope":
        problems.append(f"--rope-type {a('rope_type')}")
    return None


def _moe(a: _Args, problems: list[str]) -> dict[str, Any] | None:
    experts = a("num_experts", "num_moe_experts")
    if not experts:
        return None
    layers = int(a("num_layers"))
    expert_ffn = int(a("moe_ffn_hidden_size", "ffn_hidden_size"))
    shared = int(a("moe_shared_expert_intermediate_size", default=0))
    if shared % expert_ffn:
        problems.append(f"a shared expert of {shared} (not a multiple of moe_ffn_hidden_size {expert_ffn})")
    first_dense, frequency = _moe_layers(a("moe_layer_freq", default=1), layers, problems)
    router = a("moe_router_score_function", default="softmax")
    balancing = a("moe_router_load_balancing_type", default="aux_loss")
    kinds = list(balancing) if isinstance(balancing, (list, tuple)) else [balancing]
    coeffs = a("moe_aux_loss_coeff", default=0.0)
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
    if set(kinds) - _BALANCING:
        problems.append(f"load balancing {', '.join(sorted(set(kinds) - _BALANCING))} (Primus: aux_loss, seq_aux_loss)")
    weight = dict(zip(kinds, coeffs, strict=False))
    if a("moe_router_enable_expert_bias", default=False):
        mode = "loss_free"
    else:
        mode = "aux_loss" if "aux_loss" in kinds else "none"
    if router not in ("softmax", "sigmoid"):
        problems.append(f"--moe-router-score-function {router}")
    return {
        "num_experts": int(experts),
        "experts_per_token": int(a("moe_router_topk", default=2)),
        "expert_ffn_hidden_size": expert_ffn,
        "shared_experts": shared // expert_ffn,
        "first_dense_layers": first_dense,
        "layer_frequency": frequency,
        "router": router,
        # softmax: megatron's top-k then softmax over it (not --moe-router-pre-softmax) renormalises; sigmoid always
        "normalize_topk": router == "sigmoid" or not a("moe_router_pre_softmax", default=False),
        "balancing": mode,
        "aux_loss_coeff": float(weight.get("aux_loss", 0.0)),
        "seq_aux_loss_coeff": float(weight.get("seq_aux_loss", 0.0)),
        "expert_groups": int(a("moe_router_num_groups", default=1)),
        "groups_per_token": int(a("moe_router_group_topk", default=1)),
        "scaling_factor": float(a("moe_router_topk_scaling_factor", default=1.0)),
        "capacity_factor": a("moe_expert_capacity_factor"),
    }


def _moe_layers(freq: Any, layers: int, problems: list[str]) -> tuple[int, int]:
    """(first dense layers, MoE every N-th layer after them) of ``--moe-layer-freq`` (an int N: layer i has experts
    where i % N == 0; a list: one 0/1 flag a layer)."""
    if isinstance(freq, int):
        return 0, freq
    if not isinstance(freq, (list, tuple)) or len(freq) != layers:
        problems.append(f"--moe-layer-freq {freq!r}")
        return 0, 1
    flags = [int(bool(f)) for f in freq]
    first = next((i for i, f in enumerate(flags) if f), layers)
    rest = flags[first:]
    step = next((i for i, f in enumerate(rest[1:], 1) if f), len(rest))
    if rest != [int(i % step == 0) for i in range(len(rest))]:
        problems.append(f"--moe-layer-freq {flags} (Primus: N dense layers, then experts every k-th layer)")
    return first, step


# --- the folders ----------------------------------------------------------------------------------------------------


def _iter_folders(root: Path) -> list[tuple[int, Path]]:
    return sorted((int(m[1]), p) for p in root.iterdir() if p.is_dir() and (m := ITER.match(p.name)))


def _looks_like_iteration(path: Path) -> bool:
    return bool(ITER.match(path.name) or path.name == RELEASE) or (path / "metadata.json").is_file()


class MegatronLMFormat:
    """:class:`primus.core.contracts.native.NativeFormat` of Megatron-LM's save folders (module docstring)."""

    source = SOURCE
    expects = EXPECTS

    def recognise(self, path: Path) -> NativeCheckpoint | None:
        path = Path(path)
        if not path.is_dir():
            return None
        if (path / TRACKER).is_file():
            return self._tracked(path)
        if _looks_like_iteration(path):
            m = ITER.match(path.name)
            named = bool(m) or path.name == RELEASE  # an iter folder of a save folder: the model is named after that
            label = path.parent.absolute().name if named else path.absolute().name
            return self._iteration(path, label, int(m[1]) if m else 0, release=path.name == RELEASE)
        found = _iter_folders(path)
        if not found:
            return None
        step, newest = found[-1]
        what = f"Megatron-LM save folder {path} ({len(found)} iter_NNNNNNN folders)"
        why = f"no {TRACKER}, which Megatron-LM writes after each complete save; expected it, or name one iter folder"
        return NativeCheckpoint(SOURCE, path, step, what, f"{why} (the newest: {newest})")

    def _tracked(self, root: Path) -> NativeCheckpoint:
        said = (root / TRACKER).read_text().strip()
        if said == RELEASE:
            return self._iteration(root / RELEASE, root.absolute().name, 0, release=True)
        if not said.isdigit():
            what = f"Megatron-LM save folder {root}"
            return NativeCheckpoint(
                SOURCE, root, 0, what, f"{TRACKER} holds {said!r}; expected an iteration or 'release'"
            )
        folder = root / f"iter_{int(said):07d}"
        if not folder.is_dir():
            what = f"Megatron-LM save folder {root} (iteration {said})"
            return NativeCheckpoint(SOURCE, root, int(said), what, f"{TRACKER} names {folder.name}, which is missing")
        return self._iteration(folder, root.absolute().name, int(said), release=False)

    def _iteration(self, folder: Path, name: str, step: int, release: bool) -> NativeCheckpoint:
        label = "release checkpoint" if release else f"iteration {step}"
        legacy = sorted(p.name for p in folder.iterdir() if p.is_dir() and LEGACY.match(p.name))
        if legacy:
            what = (
                f"Megatron-LM checkpoint in the legacy torch format, {label} ({folder}/{legacy[0]}/model_optim_rng.pt)"
            )
            why = (
                "Primus imports the torch_dist format (Megatron-LM's default, --ckpt-format torch_dist); convert it "
                "with Megatron-LM (--ckpt-convert-format torch_dist --ckpt-convert-save DIR)"
            )
            return NativeCheckpoint(SOURCE, folder, step, what, why)
        if not (folder / "metadata.json").is_file():
            dcp = (folder / ".metadata").is_file()
            what = f"Megatron-LM checkpoint folder {folder} ({label})"
            why = (
                "a torch_dcp / fsdp_dtensor checkpoint (no metadata.json); expected --ckpt-format torch_dist"
                if dcp and not has_common(folder)
                else "no metadata.json, which megatron-core writes last: an unfinished save; expected a complete "
                "torch_dist folder"
            )
            return NativeCheckpoint(SOURCE, folder, step, what, why)
        backend = json.loads((folder / "metadata.json").read_text()).get("sharded_backend")
        if backend != "torch_dist":
            what = f"megatron-core checkpoint {folder} (sharded_backend {backend})"
            return NativeCheckpoint(SOURCE, folder, step, what, f"sharded_backend {backend}; expected torch_dist")
        common = read_common(folder)
        step = int(common.get("iteration", step) or 0) if not release else 0
        args = common.get("args")
        if args is None:
            what = f"megatron-core torch_dist checkpoint {folder} ({label}) without Megatron-LM's arguments"
            why = (
                "its common state holds no args (Megatron-LM's save_checkpoint stores them: this is not its "
                "checkpoint); "
                f"expected {EXPECTS}"
            )
            return NativeCheckpoint(SOURCE, folder, step, what, why)
        index = tensor_index(folder)
        rows = index.get("embedding.word_embeddings.weight", (None,))[0]
        model, problems = model_fields(args, rows, name)
        if not model:
            what = f"Megatron-LM torch_dist checkpoint, {label}"
            return NativeCheckpoint(
                SOURCE, folder, step, what, f"Primus's megatron engine does not build {problems[0]}"
            )
        layout = {k: int(getattr(args, n, None) or 1) for k, n in (("tp", "tensor_model_parallel_size"),
                  ("pp", "pipeline_model_parallel_size"), ("vpp", "virtual_pipeline_model_parallel_size"),
                  ("ep", "expert_model_parallel_size"))}  # fmt: skip
        holds, dropped = optimizer_state(index, common)
        if release:  # Megatron-LM loads a release checkpoint's weights only
            holds, dropped = holds, ("a release checkpoint: the weights alone are imported" if holds else None)
        dtype = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
        shape = f"{model['family']}, {model['num_layers']} layers, hidden {model['hidden_size']}"
        if model["moe"]:
            shape += f", {model['moe']['num_experts']} experts"
        parallel = ", ".join(f"{k.upper()} {v}" for k, v in layout.items() if v > 1 or k == "tp")
        state = "no optimizer state" if holds is None else f"optimizer state: {holds}"
        if dropped:
            state += " (not carried over)"
        what = f"Megatron-LM torch_dist checkpoint, {label} ({shape}; {dtype}; saved at {parallel}; {state})"
        problem = f"Primus's megatron engine does not build {'; '.join(problems)}" if problems else None
        details = {
            "layout": layout,
            "dtype": dtype,
            "transformer_impl": getattr(args, "transformer_impl", None),
            "optimizer": holds,
            "adam_step": adam_step(common),
            "sharding": (common.get("content_metadata") or {}).get("distrib_optim_sharding_type"),
        }
        return NativeCheckpoint(
            SOURCE,
            folder,
            step,
            what,
            problem,
            model,
            optimizer=holds is not None and not dropped,
            optimizer_dropped=dropped,
            overrides=(f"train.precision={dtype}",),  # the source's own, unless the user's words say another
            details=details,
        )


FORMAT = MegatronLMFormat()
