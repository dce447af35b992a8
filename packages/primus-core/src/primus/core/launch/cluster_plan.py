"""What ``primus plan`` computes, apart from how it prints it: the config read for a cluster, and its layouts ranked.

- The config is resolved at the cluster's world size (GPUs per node × nodes). A config whose own parallel sizes or
  global batch do not tile that cluster (a recipe written for another) is still planned: the planner searches every
  layout anyway, so it is read with its parallel section left to the search, and the reason is kept for the user.
- A layout is ranked only if it fits within the cluster's budget (usable memory less the headroom) and the engine's
  backend accepts the config with it (:func:`~primus.core.planner.auto.refusals`: core's world check, then the
  backend's own ``BackendSpec.validate`` where the backend is installed).
- The micro-batch is searched (the config's and :data:`~primus.core.planner.search.MICRO_BATCHES`, those that split
  the global batch; each layout keeps its fastest that fits, the config's where it is as fast) unless
  ``train.micro_batch_size`` is set on the command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from primus.core.config.errors import ConfigError
from primus.core.planner.auto import refusals
from primus.core.planner.engine_profile import backend_spec
from primus.core.planner.search import Candidate, Cluster, candidates

if TYPE_CHECKING:
    from primus.core.config.schema import PrimusConfig
    from primus.core.contracts.plugins import Registry
    from primus.core.contracts.protocols import ConfigIssue
    from primus.core.launch.resolve import Resolved

# what a config is refused for when its parallel sizes or batch were written for another cluster
WORLD_PATHS = frozenset({"parallel", "parallel.strategy", "train.global_batch_size"})
# the parallel section left to the search: one replica per device (the planner fills every size per layout)
ANY_LAYOUT = (
    "parallel.strategy=manual",
    "parallel.dp_replicate=1",
    "parallel.dp_shard=auto",
    "parallel.tp=1",
    "parallel.sequence_parallel=false",
    "parallel.pp=1",
    "parallel.vpp=1",
    "parallel.pp_schedule=1f1b",
    "parallel.cp=1",
)


def resolve_on(
    config: str | None, overrides: Sequence[str], world_size: int, registry: Registry | None = None
) -> tuple[Resolved, list[ConfigIssue]]:
    """``config`` resolved at ``world_size``, and why its own layout does not run there (empty where it does).

    Where the only refusals are of its parallel sizes or global batch against the world size (:data:`WORLD_PATHS`),
    it is read again with its parallel section left to the search (:data:`ANY_LAYOUT`, checked on one device: the
    planner checks each layout it ranks at ``world_size``); any other refusal is raised (:class:`ConfigError`)."""
    from primus.core.launch.resolve import resolve

    try:
        return resolve(config, list(overrides), world_size, registry, check_plugins=False), []
    except ConfigError as exc:
        if not exc.issues or any(issue.path not in WORLD_PATHS for issue in exc.issues):
            raise
        own = list(exc.issues)
    return resolve(config, [*overrides, *ANY_LAYOUT], 1, registry, check_plugins=False), own


def global_batch(res: Resolved) -> int | None:
    """The global batch the config sets (None: the planner's default, ``search.DEFAULT_BATCH_TOKENS`` a step)."""
    return res.config.train.global_batch_size if "train.global_batch_size" in res.layers.sources else None


def rank(
    cfg: PrimusConfig,
    cluster: Cluster,
    engine: str,
    registry: Registry | None = None,
    micro_batch: int | Sequence[int] = 1,
    global_batch: int | None = None,
) -> list[Candidate]:
    """Every layout ``engine`` (a backend's name: its profile, and its validation where it is installed) can run
    ``cfg`` with on ``cluster``, best first (:func:`~primus.core.planner.search.candidates`); those the planner may
    recommend (:attr:`Candidate.runnable`) come first."""
    from primus.core.planner.strategies import kernel_terms

    t = cfg.train
    spec = backend_spec(engine, registry)
    on_engine = cfg.model_copy(update={"backend": cfg.backend.model_copy(update={"name": engine})})
    return candidates(
        cfg.model,
        cluster,
        t.seq_len,
        micro_batch,
        global_batch,
        engine,
        t.precision,
        kernel_terms(cfg, registry),
        registry,
        check=refusals(on_engine, spec, cluster.world),
        lora=t.lora,
    )
