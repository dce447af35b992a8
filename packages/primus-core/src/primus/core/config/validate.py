"""Turn a layered raw config into a validated :class:`PrimusConfig`, or a :class:`ConfigError` that
names every bad key, its value and what is allowed.

Three levels of checks, each reporting all it finds: the schema (types, ranges, unknown keys), the
cross-field rules (shapes, parallel combinations, batch sizes for the world size), and the installed
plugins (backend, strategy and kernel names; the backend's own refusals).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from primus.core.config import deepseek, gpt_oss
from primus.core.config.errors import ConfigError
from primus.core.config.fields import section_model, suggest
from primus.core.config.schema import ModelConfig, PrimusConfig
from primus.core.contracts.engine import validate_with
from primus.core.contracts.protocols import KERNEL_OPS, ConfigIssue

if TYPE_CHECKING:
    from primus.core.contracts.plugins import Registry


def _walk_loc(loc: tuple[Any, ...]) -> tuple[str, type[BaseModel] | None]:
    """Dotted key path of a pydantic error location, dropping union-branch labels."""
    model: type[BaseModel] | None = PrimusConfig
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1 if parts else 0 :] = [f"{parts[-1]}[{item}]" if parts else f"[{item}]"]
        elif model is not None:
            # a field, or an unknown key (reported as such by the caller)
            parts.append(str(item))
            field = model.model_fields.get(str(item))
            model = section_model(field.annotation) if field else None
        # else: a union-branch label such as 'int' or "literal['auto']": not part of the key
    return ".".join(parts), model


def issues_from_pydantic(exc: ValidationError) -> list[ConfigIssue]:
    grouped: dict[str, ConfigIssue] = {}
    for err in exc.errors():
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            path, _ = _walk_loc(loc)
            parent_path, parent = _walk_loc(loc[:-1])
            fields = sorted(parent.model_fields) if parent else []
            hint = suggest(str(loc[-1]), fields)
            msg = f"unknown key {loc[-1]!r}" + (f"; did you mean {hint!r}?" if hint else "")
            grouped[path] = ConfigIssue(path, msg, allowed=", ".join(fields) or None)
            continue
        path, _ = _walk_loc(loc)
        msg = err["msg"].removeprefix("Value error, ")  # a validator's own message says what is wrong
        if err["type"] == "model_type" or err["type"] == "model_attributes_type":
            msg = "must be a mapping of keys"
        prev = grouped.get(path)
        if prev is not None and msg not in prev.message:
            msg = prev.message + " or " + msg.removeprefix("Input should be ")
        grouped[path] = ConfigIssue(path or "<top>", msg, value=err.get("input"))
    return list(grouped.values())


def semantic_issues(cfg: PrimusConfig) -> list[ConfigIssue]:
    """Rules that span fields, each reported at the key a user would change."""
    out: list[ConfigIssue] = []
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        out.append(
            ConfigIssue(
                "model.num_attention_heads",
                f"{m.num_attention_heads} does not divide model.hidden_size {m.hidden_size}",
                value=m.num_attention_heads,
                allowed="a divisor of hidden_size, or set model.head_dim",
            )
        )
    if m.num_attention_heads % m.num_kv_heads:
        out.append(
            ConfigIssue(
                "model.num_kv_heads",
                f"{m.num_kv_heads} does not divide model.num_attention_heads {m.num_attention_heads}",
                value=m.num_kv_heads,
                allowed="a divisor of num_attention_heads",
            )
        )

    out.extend(deepseek.issues(m))
    out.extend(gpt_oss.issues(m))
    if m.mla is not None and p.cp > 1:  # (both engines reached primus-turbo's ring attention and raised there)
        why = (
            "the context-parallel attention (primus-turbo's ring attention) takes one head width for queries, keys "
            "and values; multi-head latent attention's values are narrower (model.mla.v_head_dim)"
        )
        out.append(ConfigIssue("parallel.cp", why, value=p.cp, allowed="1"))
    if m.moe is not None:
        out.extend(_moe_issues(m))
        if t.init_from and m.moe.shared_experts and m.family != "deepseek":
            why = "Hugging Face weights of shared experts are not mapped (no Qwen3-MoE or Mixtral checkpoint has them)"
            out.append(ConfigIssue("train.init_from", why, t.init_from, "null, or model.moe.shared_experts 0"))
        if m.moe.num_experts % p.ep:
            out.append(
                ConfigIssue(
                    "parallel.ep",
                    f"{p.ep} expert-parallel ranks do not split model.moe.num_experts {m.moe.num_experts} evenly",
                    value=p.ep,
                    allowed=f"a divisor of {m.moe.num_experts}",
                )
            )
    elif p.ep > 1:
        out.append(ConfigIssue("parallel.ep", "splits experts, and the model has none (model.moe)", value=p.ep))
    if m.rope_scaling is not None and m.rope_scaling.high_freq_factor <= m.rope_scaling.low_freq_factor:
        out.append(
            ConfigIssue(
                "model.rope_scaling.high_freq_factor",
                "must exceed low_freq_factor",
                value=m.rope_scaling.high_freq_factor,
            )
        )
    if t.schedule.warmup_steps > t.steps:
        out.append(
            ConfigIssue(
                "train.schedule.warmup_steps",
                f"{t.schedule.warmup_steps} exceeds train.steps {t.steps}",
                value=t.schedule.warmup_steps,
                allowed=f"0..{t.steps}",
            )
        )
    if t.optimizer.min_lr > t.optimizer.lr:
        out.append(
            ConfigIssue(
                "train.optimizer.min_lr",
                f"{t.optimizer.min_lr} exceeds train.optimizer.lr {t.optimizer.lr}",
                value=t.optimizer.min_lr,
                allowed=f"0..{t.optimizer.lr}",
            )
        )
    if t.seq_len > m.max_position_embeddings:
        out.append(
            ConfigIssue(
                "train.seq_len",
                f"{t.seq_len} exceeds model.max_position_embeddings {m.max_position_embeddings}",
                value=t.seq_len,
            )
        )
    k = cfg.kernels
    if k.gemm_tuning != "off" and k.fp8 != "off":
        out.append(
            ConfigIssue(
                "kernels.gemm_tuning",
                f"tunes bf16 GEMMs, and kernels.fp8={k.fp8} runs the linears in FP8",
                value=k.gemm_tuning,
                allowed="off (with fp8)",
            )
        )
    if p.fsdp is True and p.distributed_optimizer:
        out.append(
            ConfigIssue(
                "parallel.distributed_optimizer",
                "parallel.fsdp: true shards the optimizer state with the parameters and gradients already",
                value=True,
                allowed="false with parallel.fsdp: true",
            )
        )
    if p.sequence_parallel and p.tp == 1:
        out.append(ConfigIssue("parallel.sequence_parallel", "needs parallel.tp > 1", value=True))
    elif p.sequence_parallel and t.seq_len % p.tp:  # every engine splits the sequence over the tp ranks
        out.append(
            ConfigIssue(
                "train.seq_len",
                f"{t.seq_len} is not divisible by parallel.tp ({p.tp}): sequence parallel splits the sequence "
                "over the tp ranks",
                value=t.seq_len,
                allowed=f"a multiple of {p.tp}",
            )
        )
    if p.vpp > 1 and p.pp == 1:
        out.append(ConfigIssue("parallel.vpp", f"{p.vpp} needs parallel.pp > 1", value=p.vpp))
    if p.pp_schedule == "interleaved_1f1b" and p.vpp == 1:
        out.append(ConfigIssue("parallel.pp_schedule", "interleaved_1f1b needs parallel.vpp > 1", value=p.pp_schedule))
    if p.recompute_layers is not None and p.recompute != "full":
        out.append(
            ConfigIssue(
                "parallel.recompute_layers", "applies only with parallel.recompute: full", value=p.recompute_layers
            )
        )
    if m.num_attention_heads % p.tp or m.num_kv_heads % p.tp and p.tp % m.num_kv_heads:
        out.append(
            ConfigIssue(
                "parallel.tp",
                f"{p.tp} must divide model.num_attention_heads ({m.num_attention_heads}) "
                f"and divide or be a multiple of model.num_kv_heads ({m.num_kv_heads})",
                value=p.tp,
            )
        )
    if p.pp * p.vpp > m.num_layers:
        out.append(
            ConfigIssue(
                "parallel.pp",
                f"pp × vpp = {p.pp * p.vpp} exceeds model.num_layers {m.num_layers}",
                value=p.pp,
                allowed=f"pp × vpp ≤ {m.num_layers}",
            )
        )
    out += eval_issues(cfg)
    out += lora_issues(cfg)
    d = cfg.data
    if d.blend and (d.source != "bundled" or d.paths):
        key = "data.paths" if d.paths else "data.source"
        out.append(
            ConfigIssue(key, "data.blend names the training sources", value=d.paths or d.source, allowed="unset")
        )
    if d.record_format != "auto" and t.objective != "sft":
        why = "names fine-tuning records (train.objective sft); pretraining reads the text under data.text_key"
        out.append(
            ConfigIssue("data.record_format", why, value=d.record_format, allowed="auto, or train.objective sft")
        )
    if d.sft_packing != "stream" and t.objective != "sft":
        why = "lays out fine-tuning chats (train.objective sft); pretraining packs its documents into one stream"
        out.append(ConfigIssue("data.sft_packing", why, value=d.sft_packing, allowed="stream, or train.objective sft"))
    if d.sft_packing == "packed" and p.cp > 1:
        why = f"with parallel.cp={p.cp}: packed chats mask attention by chat, which context parallelism does not yet"
        out.append(
            ConfigIssue("data.sft_packing", why, value=d.sft_packing, allowed="stream or padded, or parallel.cp 1")
        )
    if d.document_mask and p.cp > 1:
        out.append(
            ConfigIssue(
                "data.document_mask",
                f"with parallel.cp={p.cp}: context-parallel attention does not mask by document yet",
                value=True,
                allowed="false, or parallel.cp 1",
            )
        )
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        out.append(
            ConfigIssue(
                "train.seq_len", f"{t.seq_len} is not divisible by 2 × parallel.cp ({2 * p.cp})", value=t.seq_len
            )
        )
    return out


MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def lora_unsupported(m: ModelConfig, targets: list[str]) -> str | None:
    """Why ``train.lora`` with ``target_modules`` ``targets`` cannot adapt model ``m``, or None. Adapters target the
    projections every engine and PEFT name alike. In a mixture-of-experts layer the MLP's names match nothing, as in
    PEFT on transformers 5's fused experts (its attention and any dense layer's MLP are adapted); shared experts would
    match them (PEFT adapts ``shared_experts.gate_proj``), and are not adapted yet; nor is latent attention (its
    projections differ)."""
    if m.mla is not None:
        return "targets q/k/v/o and the MLP's projections; model.mla (latent attention) is not adapted yet"
    if m.moe is None:
        return None
    mlp = [t for t in targets if t in MLP_TARGETS]
    if mlp and m.moe.shared_experts:
        return f"{', '.join(mlp)} would adapt model.moe's shared experts, which are not adapted yet"
    dense_layers = [i for i in range(m.num_layers) if not m.moe.is_moe_layer(i)]
    if not dense_layers and not [t for t in targets if t not in MLP_TARGETS]:
        return f"{', '.join(mlp)} match no projection of this model: every layer's MLP is routed experts"
    return None


def lora_issues(cfg: PrimusConfig) -> list[ConfigIssue]:
    """``train.lora``'s engine-independent rules: a model the adapters can target, and base weights that a checkpoint
    can name (train.init_from, or the canonical initial weights of train.seed). ``train.lora.init_from``, a folder, is
    read when the config is resolved (:func:`primus.core.hf.peft.init_from_issues`)."""
    lora, t = cfg.train.lora, cfg.train
    if lora is None:
        return []
    out = []
    if why := lora_unsupported(cfg.model, lora.target_modules):
        allowed = "q_proj, k_proj, v_proj, o_proj (and, on dense layers, the MLP's) of a model without model.mla"
        path = "train.lora" if cfg.model.mla is not None else "train.lora.target_modules"
        out.append(
            ConfigIssue(path, why, value=None if cfg.model.mla is not None else lora.target_modules, allowed=allowed)
        )
    if t.init == "engine" and not t.init_from:
        why = (
            "trains adapters on frozen base weights that a checkpoint names (train.init_from, or the canonical "
            "initial weights of train.seed); train.init engine's are the engine's own and cannot be named"
        )
        out.append(ConfigIssue("train.init", why, value=t.init, allowed="canonical, or set train.init_from"))
    return out


def _moe_issues(m: ModelConfig) -> list[ConfigIssue]:
    moe, out = m.moe, []
    if moe.experts_per_token > moe.num_experts:
        out.append(
            ConfigIssue(
                "model.moe.experts_per_token",
                f"{moe.experts_per_token} exceeds model.moe.num_experts {moe.num_experts}",
                value=moe.experts_per_token,
                allowed=f"1..{moe.num_experts}",
            )
        )
    if moe.first_dense_layers >= m.num_layers:
        out.append(
            ConfigIssue(
                "model.moe.first_dense_layers",
                f"leaves no MoE layer among model.num_layers {m.num_layers}",
                value=moe.first_dense_layers,
                allowed=f"0..{m.num_layers - 1}",
            )
        )
    return out


def eval_issues(cfg: PrimusConfig) -> list[ConfigIssue]:
    """An evaluation needs data of its own: a held-out fraction of the training samples or separate inputs."""
    e = cfg.eval
    if e.source is not None and e.holdout:
        return [
            ConfigIssue(
                "eval.holdout",
                f"{e.holdout} and eval.source {e.source!r} both name the evaluation data",
                value=e.holdout,
                allowed="one of them: eval.holdout > 0 or eval.source",
            )
        ]
    if e.paths and e.source is None:
        return [ConfigIssue("eval.paths", "needs eval.source (the first input)", value=e.paths)]
    if e.interval and e.source is None and not e.holdout:
        return [
            ConfigIssue(
                "eval.interval",
                f"{e.interval} evaluates, but no evaluation data is named",
                value=e.interval,
                allowed="0, or set eval.holdout (e.g. 0.05) or eval.source",
            )
        ]
    if e.holdout and cfg.data.source == "mock":
        return [ConfigIssue("eval.holdout", "mock data is random tokens: nothing to evaluate on", value=e.holdout)]
    return []


def data_parallel_size(cfg: PrimusConfig, world_size: int) -> int:
    return cfg.parallel.dp_replicate * cfg.parallel.shard_size(world_size)


def world_issues(cfg: PrimusConfig, world_size: int) -> list[ConfigIssue]:
    """Do the parallel sizes tile the world, and do the batch sizes divide?"""
    p, t = cfg.parallel, cfg.train
    fixed = p.dp_replicate * p.tp * p.pp * p.cp
    sizes = f"dp_replicate {p.dp_replicate} × tp {p.tp} × pp {p.pp} × cp {p.cp}"
    if isinstance(p.dp_shard, int):
        product = fixed * p.dp_shard
        if product != world_size:
            return [
                ConfigIssue(
                    "parallel",
                    f"{sizes} × dp_shard {p.dp_shard} = {product}, but the world size is {world_size}",
                    allowed="sizes whose product is the world size, or dp_shard: auto",
                )
            ]
    elif world_size % fixed:
        return [
            ConfigIssue(
                "parallel",
                f"{sizes} = {fixed} does not divide the world size {world_size}",
                allowed="sizes whose product divides the world size",
            )
        ]
    dp = data_parallel_size(cfg, world_size)
    if (dp * p.cp) % p.ep:
        return [
            ConfigIssue(
                "parallel.ep",
                f"expert parallelism splits the data-parallel × context-parallel ranks ({dp} × {p.cp}); "
                f"{p.ep} does not divide them",
                value=p.ep,
                allowed=f"a divisor of {dp * p.cp}",
            )
        ]
    if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp):
        return [
            ConfigIssue(
                "train.global_batch_size",
                f"{t.global_batch_size} is not a multiple of "
                f"micro_batch_size {t.micro_batch_size} × data-parallel size {dp}",
                value=t.global_batch_size,
                allowed=f"a multiple of {t.micro_batch_size * dp}",
            )
        ]
    if p.pp > 1 and t.global_batch_size is not None:
        micro = t.global_batch_size // (t.micro_batch_size * dp)
        if p.vpp > 1 and micro % p.pp:
            return [
                ConfigIssue(
                    "train.global_batch_size",
                    f"interleaved pipelines need the number of micro-batches "
                    f"({micro}) to be a multiple of parallel.pp ({p.pp})",
                    value=t.global_batch_size,
                )
            ]
    return []


# loggers whose plugin ships in-tree, for the install hint (the plugins register under these names)
KNOWN_LOGGER_DISTS = {"wandb": "primus-loggers[wandb]", "mlflow": "primus-loggers[mlflow]"}


def registry_issues(cfg: PrimusConfig, registry: Registry, world_size: int) -> list[ConfigIssue]:
    """Names the installed plugins must know, then the chosen backend's own refusals."""
    out: list[ConfigIssue] = []
    backend = registry.backends.get(cfg.backend.name)
    if backend is None:
        out.append(
            ConfigIssue(
                "backend.name",
                registry.missing_backend_message(cfg.backend.name),
                value=cfg.backend.name,
                allowed=", ".join(sorted(registry.backends)) or "none installed",
            )
        )
    elif backend.model_families and cfg.model.family not in backend.model_families:
        # the backend's own word on a family it lacks (what it is missing) is said instead of the generic one
        own = [i for i in validate_with(backend, cfg, world_size) if i.path == "model.family"]
        out.extend(
            own
            or [
                ConfigIssue(
                    "model.family",
                    f"backend {backend.name!r} cannot run {cfg.model.family!r} models",
                    value=cfg.model.family,
                    allowed=", ".join(sorted(backend.model_families)),
                )
            ]
        )
    for name in cfg.logging.loggers:  # a logger plugin is registered under its logger's name
        if name in registry.loggers:
            continue
        dist = KNOWN_LOGGER_DISTS.get(name)
        if name in registry.pm.records:
            why = f"plugin {name!r} ({registry.pm.dist_of(name)}) is not a logger (it implements no primus_on_log)"
        else:
            why = f"no installed plugin provides the {name!r} logger" + (f": pip install '{dist}'" if dist else "")
        hint = suggest(name, registry.loggers)
        out.append(
            ConfigIssue(
                f"logging.loggers.{name}",
                why + (f"; did you mean {hint!r}?" if hint else ""),
                allowed=", ".join(registry.loggers)
                or "none installed (pip install 'primus-loggers[wandb]' or [mlflow])",
            )
        )
    strategy = cfg.parallel.strategy
    if strategy not in ("manual", "auto") and strategy not in registry.strategies:
        hint = suggest(strategy, list(registry.strategies))
        out.append(
            ConfigIssue(
                "parallel.strategy",
                f"unknown strategy {strategy!r}" + (f"; did you mean {hint!r}?" if hint else ""),
                allowed=", ".join(["manual", "auto", *sorted(registry.strategies)]),
            )
        )
    for op in KERNEL_OPS:
        if op == "gemm":
            continue
        choice = getattr(cfg.kernels, op)
        names = sorted(registry.kernel_names(op))
        if choice != "auto" and choice not in names:
            hint = suggest(choice, names)
            out.append(
                ConfigIssue(
                    f"kernels.{op}",
                    f"unknown provider {choice!r}" + (f"; did you mean {hint!r}?" if hint else ""),
                    value=choice,
                    allowed=", ".join(["auto", *names]),
                )
            )
    if backend is not None and not out:
        out.extend(validate_with(backend, cfg, world_size))
    return out


def folder_issue(key: str, folder: str | Path) -> ConfigIssue | None:
    """Why ``folder`` (named by config key ``key``) cannot be a run's writable folder, or None when it is one
    or can be made one: a file in its place, a file where a parent folder should be, no write permission in the
    nearest folder that exists. Only looks (stat, access): nothing is created."""
    path = Path(folder).expanduser().absolute()
    allowed = "a folder path you can write to (created if missing)"
    try:
        if path.is_symlink() and not path.exists():
            return ConfigIssue(key, f"{folder} is a broken symbolic link", allowed=allowed)
        if path.exists() and not path.is_dir():
            return ConfigIssue(key, f"{folder} is a file, not a folder", allowed=allowed)
        existing = path
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            return ConfigIssue(key, f"cannot create {folder}: {existing} is a file, not a folder", allowed=allowed)
    except OSError as exc:  # a parent we may not even look into
        return ConfigIssue(key, f"cannot use {folder}: {exc.strerror or exc}", allowed=allowed)
    if not os.access(existing, os.W_OK | os.X_OK):
        what = (
            f"{folder} is not writable" if existing == path else f"cannot create {folder}: {existing} is not writable"
        )
        return ConfigIssue(key, what + " (no write permission)", allowed=allowed)
    return None


def validate_config(data: dict[str, Any], world_size: int = 1, registry: Registry | None = None) -> PrimusConfig:
    """Validate a merged raw config; raise :class:`ConfigError` with every problem found."""
    try:
        cfg = PrimusConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(issues_from_pydantic(exc)) from None
    issues = semantic_issues(cfg)
    if not issues:
        issues = world_issues(cfg, world_size)
    if not issues and registry is not None:
        issues = registry_issues(cfg, registry, world_size)
    if issues:
        raise ConfigError(issues)
    return cfg


def resolve_parallel(cfg: PrimusConfig, world_size: int) -> PrimusConfig:
    """Fill ``dp_shard: auto`` and ``global_batch_size`` from the world size (already validated)."""
    p = cfg.parallel
    updates: dict[str, Any] = {}
    if p.dp_shard == "auto":
        updates["dp_shard"] = p.shard_size(world_size)
    new_parallel = p.model_copy(update=updates)
    dp = new_parallel.dp_replicate * int(new_parallel.dp_shard)
    gbs = cfg.train.global_batch_size or cfg.train.micro_batch_size * dp
    return cfg.model_copy(
        update={"parallel": new_parallel, "train": cfg.train.model_copy(update={"global_batch_size": gbs})}
    )


def grad_accumulation_steps(cfg: PrimusConfig) -> int:
    p = cfg.parallel
    dp = p.dp_replicate * int(p.dp_shard)
    return math.ceil((cfg.train.global_batch_size or 0) / (cfg.train.micro_batch_size * dp))
