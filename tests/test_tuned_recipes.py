"""Tuned recipes per GPU (issue #11): each is a valid config at its target's world size and fits that GPU by the
planner's memory model; the single-node 70B one is the layout the planner itself ranks first there.

Cross-package: the recipes are primus-tune's, the memory and the ranking the facts of the engine each recipe names
(primus-torchtitan's and primus-megatron's planner profiles), so these run where all of them are installed.

A recipe's file name says what it is and where it runs: ``<model>[-<context>]-<backend>-<layout>-<gpu>-<nodes>x<gpus
per node>.yaml`` (``llama3.2-1b-torchtitan-fsdp-h200-1x1``: one GPU, measured on the H200), and the name agrees with
the recipe's model, sequence length, backend and cluster."""

from __future__ import annotations

import re

import pytest

from primus.core.launch.cluster_plan import rank
from primus.core.launch.resolve import resolve
from primus.core.planner import Cluster, KernelTerms, candidates, device
from primus.core.planner.auto import to_parallel
from primus.core.planner.calibration import HEADROOM
from primus.core.planner.memory import GIB
from primus.core.planner.strategies import estimate_memory, fused_loss
from primus.tune.plugin import PRESETS_DIR

RECIPES = PRESETS_DIR / "recipes"  # the installed primus-tune's
NAME = re.compile(
    r"^(?P<model>.+?)(?:-(?P<context>\d+)k)?-(?P<backend>megatron|torchtitan)-(?P<layout>[a-z]+(?:-[a-z]+)*)"
    r"-(?P<gpu>h100|h200|mi300x|mi325x|mi355x)-(?P<nodes>\d+)x(?P<gpn>\d+)$"
)


def targets() -> list[tuple[str, str, int, int]]:
    out = []
    for path in sorted(RECIPES.glob("*.yaml")):
        m = NAME.match(path.stem)
        assert m, f"{path.name}: not <model>[-<context>]-<backend>-<layout>-<gpu>-<nodes>x<gpus>"
        out.append((path.stem, m["gpu"].upper(), int(m["nodes"]), int(m["gpn"])))
    return out


@pytest.mark.parametrize(("name", "gpu", "nodes", "gpn"), targets())
def test_recipe_name_says_what_it_holds(name, gpu, nodes, gpn):
    m = NAME.match(name)
    cfg = resolve(name, [], world_size=nodes * gpn, check_plugins=False).config
    c = cfg.cluster
    assert (cfg.model.name, cfg.backend.name) == (m["model"], m["backend"])
    assert (c.device, c.nodes, c.gpus_per_node) == (gpu, nodes, gpn)
    assert m["context"] is None or cfg.train.seq_len == int(m["context"]) * 1024


@pytest.mark.parametrize(("name", "gpu", "nodes", "gpn"), targets())
def test_recipe_is_valid_and_fits_its_gpu(name, gpu, nodes, gpn):
    cfg = resolve(name, [], world_size=nodes * gpn).config  # with its backend's validation (all installed here)
    need = estimate_memory(cfg, nodes * gpn).total
    have = device(gpu).memory_gib * GIB
    assert need <= have, f"{name}: {need / GIB:.1f} GiB estimated on a {have / GIB:.0f} GiB {gpu}"


def test_single_node_70b_recipe_is_the_planners_pick():
    cfg = resolve("llama3.1-70b-torchtitan-fsdp-mi300x-1x8", [], world_size=8, check_plugins=False).config
    t = cfg.train
    cands = candidates(
        cfg.model,
        Cluster(device("MI300X"), 1, 8),
        t.seq_len,
        t.micro_batch_size,
        t.global_batch_size,
        "torchtitan",
        t.precision,
        kernels=KernelTerms(fused_loss=fused_loss(cfg)),
    )
    best = next(c for c in cands if c.fits).layout
    assert (best.dp_mode, best.dp, best.tp, best.pp, best.recompute) == ("fsdp", 8, 1, 1, "full")
    assert (cfg.parallel.dp_shard, cfg.parallel.recompute) == (8, "full")


# recipes that are the planner's pick on their target: the long-context ones (context parallelism searched for long
# sequences) and the single-node Megatron FSDP2 ones with partial recompute
PICKS = {
    "llama3.1-8b-128k-megatron-cp-h200-1x8": ("H200", 1),
    "llama3.1-70b-64k-torchtitan-fsdp-tp-cp-mi300x-8x8": ("MI300X", 8),
    "llama3.1-70b-megatron-fsdp-mi325x-1x8": ("MI325X", 1),
    "llama3.1-70b-megatron-fsdp-mi355x-1x8": ("MI355X", 1),
}


@pytest.mark.parametrize("name", sorted(PICKS))
def test_recipe_is_the_planners_pick(name):
    """Each of these recipes is the layout the planner ranks first (and its engine accepts) for the recipe's own
    model, sequence, micro-batch, global batch and cluster, with `primus plan`'s headroom."""
    gpu, nodes = PICKS[name]
    cfg = resolve(name, [], world_size=nodes * 8).config
    t = cfg.train
    cluster = Cluster(device(gpu), nodes, 8, HEADROOM)  # as `primus plan` keeps it
    ranked = rank(cfg, cluster, cfg.backend.name, None, t.micro_batch_size, t.global_batch_size)
    best = next(c for c in ranked if c.runnable).layout
    assert cfg.parallel.cp == best.cp and (best.cp > 1) == ("-cp-" in name)
    want = {k: v for k, v in to_parallel(best).items() if k not in ("fsdp", "pp_schedule")}  # fsdp: auto reads dp_shard
    got = cfg.parallel.model_dump()
    assert {k: got[k] for k in want} == want
