"""``parallel.strategy: auto``: let the planner pick the layout at train time; and what a layout is as a config.

Fields the user set explicitly under ``parallel`` (any layer but the defaults) are kept: the planner
only considers layouts that agree with them. The device is the one this process sees (the first
GPU, or the host for CPU runs). The engine is ``backend.name``'s, planned with its backend's profile
(:mod:`primus.core.planner.engine_profile`; the generic engine's where it gives none), and only the layouts its backend's
own validation accepts are picked (:func:`refusals`), as in ``primus plan``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from primus.core.config.errors import ConfigError
from primus.core.config.schema import ParallelConfig, PrimusConfig
from primus.core.config.validate import world_issues
from primus.core.contracts.engine import validate_with
from primus.core.contracts.errors import UserError
from primus.core.contracts.protocols import ConfigIssue
from primus.core.planner import calibration as cal
from primus.core.planner.engine_profile import backend_spec
from primus.core.planner.hardware import Device, device
from primus.core.planner.memory import GIB, Layout
from primus.core.planner.search import Candidate, Cluster, candidates

if TYPE_CHECKING:
    from primus.core.contracts.engine import BackendSpec
    from primus.core.contracts.plugins import Registry

log = logging.getLogger("primus.planner")


def local_device() -> Device:
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return device(props.name, props.total_memory / GIB)
    except ImportError:
        pass
    return device("CPU", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB)


def to_parallel(layout: Layout) -> dict[str, Any]:
    """The ``parallel`` section's fields that ask the engine for ``layout``."""
    out: dict[str, Any] = {
        "dp_replicate": layout.dp if layout.dp_mode != "fsdp" else 1,
        "dp_shard": layout.dp if layout.dp_mode == "fsdp" else 1,
        "distributed_optimizer": layout.dp_mode == "ddp_distopt",
        "fsdp": layout.dp_mode == "fsdp",
        "tp": layout.tp,
        "sequence_parallel": layout.tp > 1,
        "cp": layout.cp,
        "pp": layout.pp,
        "vpp": layout.vpp,
        "pp_schedule": "interleaved_1f1b" if layout.vpp > 1 else "1f1b",
        "ep": layout.ep,
        "recompute": "full" if layout.recompute == "partial" else layout.recompute,
    }
    if layout.recompute == "partial":  # in the config the way the engine's profile says (None: it cannot be)
        method = layout.engine_profile.partial_recompute_method
        out.update(recompute_method=method, recompute_layers=layout.recompute_layers)
    else:  # a recipe's own partial recompute does not carry over to another layout
        out.update(recompute_method=ParallelConfig.model_fields["recompute_method"].default, recompute_layers=None)
    return out


def layout_config(cfg: PrimusConfig, layout: Layout) -> PrimusConfig:
    """``cfg`` as it would run ``layout``: its parallel section and batch sizes filled (the global batch the layout
    splits: micro-batch × micro-batches × data-parallel size), on the layout's engine."""
    train = cfg.train.model_copy(
        update={
            "micro_batch_size": layout.micro_batch,
            "global_batch_size": layout.micro_batch * layout.micro_batches * layout.dp,
        }
    )
    parallel = cfg.parallel.model_copy(update=to_parallel(layout))
    backend = cfg.backend.model_copy(update={"name": layout.engine})
    return cfg.model_copy(update={"parallel": parallel, "train": train, "backend": backend})


def _word(value: Any) -> str:
    """A value as a ``key=value`` override writes it (YAML: true / false / null)."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def layout_overrides(cfg: PrimusConfig, layout: Layout) -> list[str]:
    """The ``key=value`` words that turn ``cfg`` into :func:`layout_config` ``(cfg, layout)``: the parallel fields and
    batch sizes that differ (the sharding switches only where there is more than one replica), and ``parallel.strategy=manual`` where the config leaves the layout to a strategy (the
    words then say it all)."""
    run = layout_config(cfg, layout)
    words = [f"backend.name={layout.engine}"] if layout.engine != cfg.backend.name else []
    strategy = cfg.parallel.strategy != "manual"  # its sizes were a strategy's: with manual, each must be said
    if strategy:
        words.append("parallel.strategy=manual")
    for key, value in to_parallel(layout).items():
        if layout.dp == 1 and key in ("fsdp", "distributed_optimizer"):
            continue  # one replica: nothing to shard, whatever the config says
        if strategy or getattr(cfg.parallel, key) != value:
            words.append(f"parallel.{key}={_word(value)}")
    for key in ("micro_batch_size", "global_batch_size"):
        if getattr(cfg.train, key) != getattr(run.train, key):
            words.append(f"train.{key}={getattr(run.train, key)}")
    return words


def refusals(cfg: PrimusConfig, spec: BackendSpec | None, world_size: int) -> Callable[[Layout], list[str]]:
    """``check(layout)`` for :func:`~primus.core.planner.search.candidates`: why ``cfg`` cannot run a layout on
    ``world_size`` devices ("path: message" each; empty where it can): core's own check of the sizes against the world,
    then the backend's validation (``spec``'s ``BackendSpec.validate``; None: no backend to ask)."""

    def check(layout: Layout) -> list[str]:
        run = layout_config(cfg, layout)
        issues = world_issues(run, world_size) or (validate_with(spec, run, world_size) if spec is not None else [])
        return [f"{issue.path}: {issue.message}" for issue in issues]

    return check


def _agrees(cand: Candidate, explicit: dict[str, Any]) -> bool:
    filled = to_parallel(cand.layout)
    return all(filled.get(k, v) == v for k, v in explicit.items())


def ranked(
    cfg: PrimusConfig,
    world_size: int,
    dev: Device,
    registry: Registry | None = None,
    micro_batch: int | tuple[int, ...] | None = None,
) -> list[Candidate]:
    """Every layout the planner sees for ``cfg``'s run on ``world_size`` × ``dev`` (``LOCAL_WORLD_SIZE`` devices a
    node), best first, at the run's global batch and ``micro_batch`` (the sizes to try; None: the config's), those it
    may recommend first (:func:`~primus.core.planner.search.candidates`)."""
    gpn = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cluster = Cluster(dev, max(world_size // gpn, 1), gpn, cal.HEADROOM)
    t = cfg.train
    from primus.core.planner.strategies import kernel_terms  # strategies imports the planner

    return candidates(
        cfg.model,
        cluster,
        t.seq_len,
        t.micro_batch_size if micro_batch is None else micro_batch,
        t.global_batch_size,
        cfg.backend.name,
        t.precision,
        kernel_terms(cfg, registry),
        registry,
        check=refusals(cfg, backend_spec(cfg.backend.name, registry), world_size),
        lora=t.lora,
    )


def _typeable(cand: Candidate) -> bool:
    """A layout a config can ask for: a partial recompute only where the engine's profile names the
    ``recompute_method`` that asks for it."""
    return cand.runnable and not (
        cand.layout.recompute == "partial" and cand.layout.engine_profile.partial_recompute_method is None
    )


def choose(
    cfg: PrimusConfig,
    explicit_keys: set[str],
    world_size: int,
    dev: Device | None = None,
    registry: Registry | None = None,
) -> PrimusConfig:
    """``cfg`` with its parallel section filled by the best layout that fits. ``registry``: where the backend's
    profile is looked up first (then among the installed backends) and the kernel providers (None: the process's)."""
    dev = dev or local_device()
    explicit = {k: getattr(cfg.parallel, k) for k in explicit_keys if k not in ("strategy",)}
    every = ranked(cfg, world_size, dev, registry)
    cands = [c for c in every if _typeable(c) and _agrees(c, explicit)]
    if not cands:
        gpn = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        cluster = Cluster(dev, max(world_size // gpn, 1), gpn, cal.HEADROOM)
        allowed = [c for c in every if _agrees(c, explicit)] or every
        accepted = [c for c in allowed if not c.refused] or allowed
        smallest = min(accepted, key=lambda c: c.memory.total) if accepted else None
        need = (
            f"; the smallest ({smallest.layout.describe()}) needs {smallest.memory.total / GIB:.1f} GiB per device"
            if smallest
            else ""
        )
        refused = sorted({r for c in allowed if c.fits for r in c.refused})
        why = f"; {cfg.backend.name} refuses the layouts that fit: {'; '.join(refused[:3])}" if refused else ""
        raise ConfigError(
            [
                ConfigIssue(
                    "parallel.strategy",
                    f"auto: no layout fits {world_size} × {dev.name} "
                    f"({dev.memory_gib:.0f} GiB, {cluster.capacity / GIB:.1f} usable, {cluster.budget / GIB:.1f} with "
                    f"{cluster.headroom:.0%} headroom) with the parallel settings given ({explicit or 'none'}){need}"
                    f"{why}; `primus plan` ranks them",
                )
            ]
        )
    pick = cands[0]
    log.info(
        "planner: %s (est. %.1f GiB/device, %.2f s/step)",
        pick.layout.describe(),
        pick.memory.total / GIB,
        pick.time.total,
    )
    return cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update=to_parallel(pick.layout))})


def advice(
    cfg: PrimusConfig,
    world_size: int,
    dev: Device,
    registry: Registry | None = None,
    micro_batch: int | tuple[int, ...] | None = None,
) -> str:
    """What to type instead of ``cfg``'s layout: the planner's pick for the run (its ``key=value`` words, last, to copy
    as they are), or that none fits ``world_size`` × ``dev``."""
    pick = next((c for c in ranked(cfg, world_size, dev, registry, micro_batch) if _typeable(c)), None)
    if pick is None:
        return f"no layout fits {world_size} × {dev.name}: use more devices (`primus plan` ranks the layouts)"
    est = f"{pick.layout.describe()}, est. {pick.memory.total / GIB:.1f} GiB per device"
    if not (words := layout_overrides(cfg, pick.layout)):
        return (
            f"the planner's pick is this run's own layout ({est}): the memory model misses what filled the device; "
            "recompute more (parallel.recompute=full) or lower train.micro_batch_size"
        )
    return f"the planner's pick ({est}): add {' '.join(words)}"


def check_fits(
    cfg: PrimusConfig,
    world_size: int,
    dev: Device | None = None,
    registry: Registry | None = None,
    micro_batch: int | tuple[int, ...] | None = None,
) -> str | None:
    """Hold a run to the planner's band, before any model is built. The band is the memory model's validated error
    (``calibration.FIT_TOLERANCE``) either side of the device's usable memory: an estimate below it fits (None); one
    inside it may not fit (a warning, returned); one past it is refused (:class:`UserError`), or only warned of with
    ``train.allow_tight_fit``. Each names the estimate, the device's memory and the planner's pick as the words to
    type, last (:func:`advice`; ``micro_batch``: the sizes it may pick from, None: the config's). Every backend is checked:
    with its profile, or as the generic engine where it gives none."""
    from primus.core.planner.search import USABLE
    from primus.core.planner.strategies import estimate_memory

    dev = dev or local_device()
    est = estimate_memory(cfg, world_size, registry)
    need, have = est.total / GIB, dev.memory_gib
    usable, band = have * USABLE, cal.FIT_TOLERANCE
    if need <= usable * (1 - band):
        return None
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in est.parts.items() if abs(v) >= 0.05 * GIB)
    said = f"an estimated {need:.1f} GiB per device ({parts}) on {dev.name} with {have:.1f} GiB ({usable:.1f} usable)"
    instead = advice(cfg, world_size, dev, registry, micro_batch)
    if need <= usable * (1 + band):
        return (
            f"{cfg.model.name} may not fit: {said}, within the memory model's ±{band:.0%} of the usable memory; "
            f"{instead}"
        )
    if cfg.train.allow_tight_fit:
        return f"{cfg.model.name} does not fit by the memory model: {said}; train.allow_tight_fit runs it; {instead}"
    raise UserError(
        f"{cfg.model.name} does not fit: {said}, past the memory model's ±{band:.0%} (train.allow_tight_fit=true "
        f"runs it anyway); {instead}"
    )
