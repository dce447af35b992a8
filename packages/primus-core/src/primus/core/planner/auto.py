"""``parallel.strategy: auto``: let the planner pick the layout at train time.

Fields the user set explicitly under ``parallel`` (any layer but the defaults) are kept: the planner
only considers layouts that agree with them. The device is the one this process sees (the first
GPU, or the host for CPU runs). The engine is ``backend.name``'s, planned with its backend's profile
(:mod:`primus.core.planner.profile`; the generic engine's where it gives none).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from primus.core.config.schema import PrimusConfig
from primus.core.planner import calibration as cal
from primus.core.planner.hardware import Device, device
from primus.core.planner.memory import GIB, Layout
from primus.core.planner.profile import profile_of
from primus.core.planner.search import Candidate, Cluster, candidates

if TYPE_CHECKING:
    from primus.core.plugins import Registry

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
    out: dict[str, Any] = {
        "dp_replicate": layout.dp if layout.dp_mode != "fsdp" else 1,
        "dp_shard": layout.dp if layout.dp_mode == "fsdp" else 1,
        "distributed_optimizer": layout.dp_mode == "ddp_distopt",
        "tp": layout.tp,
        "sequence_parallel": layout.tp > 1,
        "pp": layout.pp,
        "vpp": layout.vpp,
        "pp_schedule": "interleaved_1f1b" if layout.vpp > 1 else "1f1b",
        "recompute": "full" if layout.recompute == "partial" else layout.recompute,
    }
    if layout.recompute == "partial":  # in the config the way the engine's profile says (None: it cannot be)
        method = layout.engine_profile.partial_recompute_method
        out.update(recompute_method=method, recompute_layers=layout.recompute_layers)
    return out


def _agrees(cand: Candidate, explicit: dict[str, Any]) -> bool:
    filled = to_parallel(cand.layout)
    return all(filled.get(k, v) == v for k, v in explicit.items())


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
    gpn = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cluster = Cluster(dev, max(world_size // gpn, 1), gpn)
    t = cfg.train
    explicit = {k: getattr(cfg.parallel, k) for k in explicit_keys if k not in ("strategy",)}
    from primus.core.strategies import kernel_terms  # strategies imports the planner

    engine = profile_of(cfg.backend.name, registry)
    every = candidates(
        cfg.model,
        cluster,
        t.seq_len,
        t.micro_batch_size,
        t.global_batch_size,
        engine,
        t.precision,
        kernel_terms(cfg, registry),
    )
    cands = [
        c
        for c in every
        # a partial recompute the config cannot ask for (the profile names no recompute_method for it) is not picked
        if c.fits
        and _agrees(c, explicit)
        and not (c.layout.recompute == "partial" and engine.partial_recompute_method is None)
    ]
    if not cands:
        from primus.core.config.errors import ConfigError
        from primus.core.protocols import ConfigIssue

        allowed = [c for c in every if _agrees(c, explicit)] or every
        smallest = min(allowed, key=lambda c: c.memory.total) if allowed else None
        need = (
            f"; the smallest ({smallest.layout.describe()}) needs {smallest.memory.total / GIB:.1f} GiB per device"
            if smallest
            else ""
        )
        raise ConfigError(
            [
                ConfigIssue(
                    "parallel.strategy",
                    f"auto: no layout fits {world_size} × {dev.name} "
                    f"({dev.memory_gib:.0f} GiB, {cluster.capacity / GIB:.1f} usable) with the parallel settings "
                    f"given ({explicit or 'none'}){need}; `primus plan` ranks them",
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


def check_fits(cfg: PrimusConfig, world_size: int, dev: Device | None = None, registry: Registry | None = None) -> None:
    """Refuse, before any model is built, a layout whose estimated per-device memory exceeds the device's
    by more than the memory model's validated error (``calibration.FIT_TOLERANCE``), with the numbers.
    Every backend is checked: with its profile, or as the generic engine where it gives none."""
    from primus.core.errors import UserError
    from primus.core.strategies import estimate_memory

    dev = dev or local_device()
    est = estimate_memory(cfg, world_size, registry)
    need, have = est.total / GIB, dev.memory_gib
    if need <= have * (1 + cal.FIT_TOLERANCE):
        return
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in est.parts.items() if abs(v) >= 0.05 * GIB)
    raise UserError(
        f"{cfg.model.name} does not fit: an estimated {need:.1f} GiB per device ({parts}) on "
        f"{dev.name} with {have:.0f} GiB; use more devices, parallel.recompute, parallel.strategy=auto, or "
        "see `primus plan` for layouts that fit"
    )
