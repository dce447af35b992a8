"""``parallel.strategy: auto``: let the planner pick the layout at train time.

Fields the user set explicitly under ``parallel`` (any layer but the defaults) are kept: the planner
only considers layouts that agree with them. The device is the one this process sees (the first
GPU, or the host for CPU runs).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from primus.core.config.schema import PrimusConfig
from primus.core.planner.hardware import Device, device
from primus.core.planner.memory import GIB, Layout
from primus.core.planner.search import Candidate, Cluster, candidates

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
    if layout.recompute == "partial":
        out.update(recompute_method="block", recompute_layers=layout.recompute_layers)
    return out


def _agrees(cand: Candidate, explicit: dict[str, Any]) -> bool:
    filled = to_parallel(cand.layout)
    return all(filled.get(k, v) == v for k, v in explicit.items())


def choose(cfg: PrimusConfig, explicit_keys: set[str], world_size: int, dev: Device | None = None) -> PrimusConfig:
    dev = dev or local_device()
    gpn = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cluster = Cluster(dev, max(world_size // gpn, 1), gpn)
    t = cfg.train
    explicit = {k: getattr(cfg.parallel, k) for k in explicit_keys if k not in ("strategy",)}
    cands = [
        c
        for c in candidates(
            cfg.model, cluster, t.seq_len, t.micro_batch_size, t.global_batch_size, cfg.backend.name, t.precision
        )
        # TorchTitan's "checkpoint every k-th block" has no field in the schema yet
        if c.fits
        and _agrees(c, explicit)
        and not (cfg.backend.name == "torchtitan" and c.layout.recompute == "partial")
    ]
    if not cands:
        from primus.core.config.errors import ConfigError
        from primus.core.protocols import ConfigIssue

        raise ConfigError(
            [
                ConfigIssue(
                    "parallel.strategy",
                    f"auto: no layout fits {world_size} × {dev.name} "
                    f"({dev.memory_gib:.0f} GiB) with the parallel settings given "
                    f"({explicit or 'none'}); run `primus plan` to see the numbers",
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
