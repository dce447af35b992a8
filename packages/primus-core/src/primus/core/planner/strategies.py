"""Built-in parallel strategies: how each fills the parallel section, and its per-device memory estimate
(the planner's model, :mod:`primus.core.planner.memory`, applied to the filled layout with the facts of the
engine ``backend.name`` names: its backend's planner profile, else the generic engine's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from primus.core.config.schema import PrimusConfig
from primus.core.contracts.plugins import get_registry
from primus.core.contracts.protocols import MemoryEstimate, StrategySpec

if TYPE_CHECKING:
    from primus.core.contracts.plugins import Registry
    from primus.core.planner.hardware import Device
    from primus.core.planner.memory import KernelTerms, Layout
    from primus.core.planner.search import Candidate


def _rest(parallel: dict[str, Any], world_size: int, *used: str) -> int:
    fixed = 1
    for key in used:
        fixed *= int(parallel.get(key, 1))
    return max(world_size // fixed, 1)


def fill_ddp(parallel: dict[str, Any], world_size: int, cfg: PrimusConfig | None = None) -> dict[str, Any]:
    out = dict(parallel, dp_shard=1)
    out["dp_replicate"] = _rest(out, world_size, "tp", "pp", "cp")
    out["distributed_optimizer"] = True  # explicit settings are kept by the caller
    return out


def fill_fsdp2(parallel: dict[str, Any], world_size: int, cfg: PrimusConfig | None = None) -> dict[str, Any]:
    out = dict(parallel, dp_replicate=1)
    out["dp_shard"] = _rest(out, world_size, "tp", "pp", "cp")
    return out


def fill_tp_pp_vpp(parallel: dict[str, Any], world_size: int, cfg: PrimusConfig | None = None) -> dict[str, Any]:
    out = dict(parallel)
    if out.get("tp", 1) == 1:
        out["tp"] = min(8, world_size)
    out["sequence_parallel"] = out["tp"] > 1
    out["dp_shard"] = 1
    out["dp_replicate"] = _rest(out, world_size, "tp", "pp", "cp")
    out["distributed_optimizer"] = True  # explicit settings are kept by the caller
    return out


def config_layout(cfg: PrimusConfig, world_size: int, registry: Registry | None = None) -> Layout:
    """The planner's :class:`~primus.core.planner.memory.Layout` of ``cfg``'s own parallel section on ``world_size``
    devices, with its engine's profile (``registry`` first, then the installed backends)."""
    from primus.core.planner.engine_profile import profile_of
    from primus.core.planner.memory import Layout

    p, t = cfg.parallel, cfg.train
    shard = p.shard_size(world_size)
    dp = p.dp_replicate * shard
    mode = "fsdp" if shard > 1 else "ddp_distopt" if p.distributed_optimizer else "ddp"
    recompute, layers = p.recompute, 0
    if p.recompute == "full" and p.recompute_method == "block" and p.recompute_layers:
        recompute, layers = "partial", p.recompute_layers
    engine, profile = cfg.backend.name, profile_of(cfg.backend.name, registry)
    micro_batches = max((t.global_batch_size or t.micro_batch_size * dp) // (t.micro_batch_size * dp), 1)
    return Layout(
        engine, mode, dp, p.tp, p.pp, p.vpp, p.cp, recompute, layers, t.micro_batch_size, micro_batches, profile, p.ep
    )


def estimate_memory(cfg: PrimusConfig, world_size: int, registry: Registry | None = None) -> MemoryEstimate:
    """Per-device memory of ``cfg``'s layout. ``registry``: where the backend's profile is looked up first (then
    among the installed backends) and the kernel providers (None: the process's registry)."""
    from primus.core.planner.memory import estimate

    layout, t = config_layout(cfg, world_size, registry), cfg.train
    kernels = kernel_terms(cfg, registry)
    return MemoryEstimate(estimate(cfg.model, layout, t.seq_len, t.precision, kernels, t.lora).parts)


def predicted(
    cfg: PrimusConfig,
    world_size: int,
    dev: Device,
    gpus_per_node: int | None = None,
    registry: Registry | None = None,
) -> Candidate:
    """The planner's memory and step time (tokens/s per device, MFU) of ``cfg``'s own layout on ``world_size`` × ``dev``
    (``gpus_per_node``: None, all on one node), with its kernels: what ``primus plan`` shows for that layout."""
    from primus.core.planner.search import Cluster, evaluate

    layout, t = config_layout(cfg, world_size, registry), cfg.train
    gpn = gpus_per_node or world_size
    gbs = layout.micro_batch * layout.micro_batches * layout.dp
    cluster = Cluster(dev, max(world_size // gpn, 1), gpn)
    return evaluate(cfg.model, layout, t.seq_len, gbs, cluster, t.precision, kernel_terms(cfg, registry), t.lora)


def kernel_terms(cfg: PrimusConfig, registry: Registry | None = None) -> KernelTerms:
    """What ``cfg``'s kernels change in the planner: FP8 in the recipe's layers (and head), torch.compile, the fused
    loss and the fused norm and SwiGLU (``registry``'s providers; None: the process's)."""
    from primus.core.kernels.fp8_recipe import fp8_output_head
    from primus.core.planner.memory import KernelTerms, fp8_layers

    k = cfg.kernels
    n_fp8 = fp8_layers(cfg.model, k.fp8, k.fp8_recipe.bf16_first_layers, k.fp8_recipe.bf16_last_layers)
    # experts: auto takes FP8 where the provider measured its grouped GEMM faster on the device
    # (primus.core.kernels.fp8_experts); no device is yet (H100 0.44x), so the planner counts them bf16
    experts = k.fp8_recipe.experts == "fp8"
    return KernelTerms(
        k.fp8,
        n_fp8,
        fused_loss(cfg, registry),
        fp8_output_head(k),
        cfg.train.compile,
        k.fp8_recipe.linears,
        experts,
        fused_elementwise(cfg, registry),
    )


def fused_loss(cfg: PrimusConfig, registry: Registry | None = None) -> bool:
    """Whether ``kernels.cross_entropy`` picks a provider that fuses the output projection (its ``features``),
    as ``auto`` does on a GPU: the highest-priority provider ``registry`` holds (None: the process's registry)."""
    if registry is None:
        registry = get_registry()
    providers = registry.providers("cross_entropy")
    choice = cfg.kernels.cross_entropy
    chosen = next((p for p in providers if choice in ("auto", p.name)), None)
    return chosen is not None and "linear_cross_entropy" in chosen.features


def chosen_provider(cfg: PrimusConfig, op: str, registry: Registry | None = None) -> str | None:
    """The provider ``kernels.<op>`` picks as ``auto`` does on a GPU: the highest-priority one ``registry`` holds
    (None: the process's registry), or the one named; None where there is none."""
    if registry is None:
        registry = get_registry()
    choice = getattr(cfg.kernels, op)
    return next((p.name for p in registry.providers(op) if choice in ("auto", p.name)), None)


def fused_elementwise(cfg: PrimusConfig, registry: Registry | None = None) -> bool:
    """Whether the run's RMSNorm and SwiGLU run on a provider's kernels rather than core's reference (``torch``): the
    step-time model's ``KernelTerms.fused_elementwise``."""
    return all(chosen_provider(cfg, op, registry) not in (None, "torch") for op in ("rms_norm", "swiglu"))


BUILTIN_STRATEGIES = [
    StrategySpec(
        "ddp", "data parallel, replicated weights; distributed optimizer shards Adam state", fill_ddp, estimate_memory
    ),
    StrategySpec(
        "fsdp2", "fully sharded data parallel (params, grads, optimizer sharded)", fill_fsdp2, estimate_memory
    ),
    StrategySpec(
        "tp_pp_vpp",
        "tensor + sequence parallel within a node, pipeline (+ virtual stages) across",
        fill_tp_pp_vpp,
        estimate_memory,
    ),
]
