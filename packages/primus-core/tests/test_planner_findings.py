"""The planner's findings of issue 22, on core's machinery (no engine installed: the fake backend, core's generic engine
and backends of these tests' own): a recipe is read at the cluster's world size; only layouts the backend's own
validation accepts are recommended; a layout must leave a headroom free, and the micro-batch is searched;
``train.compile`` changes the step time. The in-tree engines' side: tests/test_plan_backends.py."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from primus.core import hookimpl
from primus.core.cli import app as cli
from primus.core.config.presets import model_config
from primus.core.config.validate import validate_config
from primus.core.contracts.engine import BackendSpec
from primus.core.contracts.plugins import DISABLE_ENV, Registry, build_plugin_manager
from primus.core.contracts.protocols import ConfigIssue
from primus.core.launch.cluster_plan import rank, resolve_on
from primus.core.planner import GENERIC, Cluster, KernelTerms, Layout, best, candidates, device
from primus.core.planner import calibration as cal
from primus.core.planner.auto import layout_config
from primus.core.planner.memory import GIB
from primus.core.planner.perf import step_time

RECIPE_405B = "llama3.1-405b-megatron-tp-pp-vpp"  # tp 8 × pp 7 = 56 devices a replica, global batch 252


def _plan(*args: str):
    return CliRunner().invoke(cli.app, ["plan", *args])


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one line per layout


def _rows(output: str) -> list[dict[str, str]]:
    """The plan table's rows as {column: cell} (the layout cell holds spaces: the others are read from the right)."""
    lines = output.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["#", "layout"])
    names = lines[head].replace("total GiB", "total").replace("step s", "step").split()[2:]
    rows = []
    for ln in lines[head + 1 :]:
        cells = ln.split()
        if not cells or not cells[0].isdigit():
            break
        layout = " ".join(cells[1 : len(cells) - len(names)])
        rows.append({"layout": layout, **dict(zip(names, cells[len(cells) - len(names) :], strict=True))})
    return rows


# ------------------------------------------------------------------------------ 1. the cluster's world size


def test_a_recipe_is_read_at_the_clusters_world_size(registry):
    res, own = resolve_on(RECIPE_405B, [], 56, registry)
    assert own == [] and res.world_size == 56  # its own layout: tp 8 × pp 7 on 56 devices
    assert (res.config.parallel.tp, res.config.parallel.pp, res.config.parallel.vpp) == (8, 7, 3)
    # on 64 devices its own layout does not run: said, and the model is planned all the same
    res, own = resolve_on(RECIPE_405B, [], 64, registry)
    assert [issue.path for issue in own] == ["parallel"] and "56 does not divide the world size 64" in own[0].message
    assert res.config.train.global_batch_size == 252 and res.config.model.num_layers == 126


def test_plan_of_a_fixed_size_recipe_on_its_cluster(cli_registry):
    """The recipe validated at world size 1 was refused ("56 does not divide the world size 1") on any cluster."""
    run = _plan(RECIPE_405B, "--engine", "fake", "--device", "MI300X", "--gpus", "8", "--nodes", "7")
    assert run.exit_code == 0, run.output
    assert "world size 1" not in run.output and "note: the config's own layout" not in run.output
    assert "7×8 MI300X" in run.output and "recommended: " in run.output
    other = _plan(RECIPE_405B, "--engine", "fake", "--device", "MI300X", "--gpus", "8", "--nodes", "8")
    assert "world size 1" not in other.output
    assert "note: the config's own layout does not run on 8×8 GPUs" in other.output
    assert "56 does not divide the world size 64" in other.output and "8×8 MI300X" in other.output


def test_a_refusal_that_is_not_the_clusters_is_reported(cli_registry):
    run = _plan(RECIPE_405B, "train.seq_len=-1", "--engine", "fake", "--nodes", "7")
    assert run.exit_code == 2 and "train.seq_len" in run.output


# ------------------------------------------------------------------------ 2. what the backend accepts


def _no_tp_no_pp(cfg, world_size):
    """A backend that refuses tensor and pipeline parallelism, and torch.compile (in every layout)."""
    p = cfg.parallel
    out = []
    if cfg.train.compile:
        out.append(ConfigIssue("train.compile", "this engine does not compile", True, "false"))
    if p.tp > 1:
        out.append(ConfigIssue("parallel.tp", "this engine has no tensor parallelism", p.tp, "1"))
    if p.pp > 1:
        out.append(ConfigIssue("parallel.pp", "this engine has no pipeline parallelism", p.pp, "1"))
    return out


@pytest.fixture
def strict(monkeypatch) -> Registry:
    """Core and "strict" (the generic engine's facts; no TP, PP or compile) as the CLI's registry."""
    from primus.core.contracts import plugins

    class Strict:
        @staticmethod
        @hookimpl
        def primus_backends():
            return [
                BackendSpec(
                    name="strict",
                    description="refuses TP and PP",
                    engine="primus.core.run.testing:StandInEngine",
                    validate=_no_tp_no_pp,
                    model_families=frozenset({"llama", "qwen2", "qwen3", "mistral"}),
                )
            ]

    monkeypatch.setenv(DISABLE_ENV, "1")
    reg = Registry(build_plugin_manager(extra_plugins=[("strict", Strict)]))
    monkeypatch.setattr(plugins, "_cached", reg)
    return reg


def test_only_layouts_the_backend_accepts_are_recommended(strict):
    res, _ = resolve_on("llama3.1-70b", ["train.seq_len=4096", "backend.name=strict"], 32, strict)
    cluster = Cluster(device("H200"), 4, 8, cal.HEADROOM)
    unchecked = best(candidates(res.config.model, cluster, 4096, 1, None, GENERIC))
    assert unchecked.layout.tp > 1 or unchecked.layout.pp > 1  # what the generic engine would pick: refused here
    ranked = rank(res.config, cluster, "strict", strict, (1, 2, 4), None)
    runnable = [c for c in ranked if c.runnable]
    assert runnable and all(c.layout.tp == c.layout.pp == 1 for c in runnable)
    assert any(c.fits and c.refused for c in ranked)  # those it refuses are kept, with the reason, never ranked first
    assert ranked[: len(runnable)] == runnable
    for c in runnable[:5]:  # and each is a config the backend (and core) accept as it would run
        validate_config(layout_config(res.config, c.layout).model_dump(), world_size=32, registry=strict)


def test_the_plan_says_what_the_backend_refuses(strict):
    run = _plan("llama3.1-70b", "train.seq_len=4096", "--engine", "strict", "--device", "H200", "--nodes", "4")
    assert run.exit_code == 0, run.output
    assert all("TP" not in row["layout"] and "PP" not in row["layout"] for row in _rows(run.output))
    assert re.search(r"note: \d+ layouts that fit are left out, strict refuses them: parallel\.(tp|pp)", run.output)
    # where it refuses every layout that fits: an error with its reasons, no recommendation
    none = _plan("llama3.1-8b-torchtitan-fsdp", "--engine", "strict", "--device", "H200")
    assert none.exit_code == 4 and "recommended" not in none.output
    assert "strict refuses every layout that fits: train.compile: this engine does not compile" in none.output


def test_strategy_auto_picks_only_what_the_backend_accepts(strict, monkeypatch):
    from primus.core.launch.resolve import resolve
    from primus.core.planner import auto

    monkeypatch.setattr(auto, "local_device", lambda: device("H200"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    res = resolve(
        "llama3.1-70b",
        ["backend.name=strict", "parallel.strategy=auto", "train.seq_len=4096", "train.micro_batch_size=1"],
        world_size=32,
        registry=strict,
    )
    p = res.config.parallel
    assert p.tp == p.pp == 1 and p.dp_replicate * p.dp_shard == 32


def test_a_layout_is_the_config_it_names(registry):
    """What the planner validates is what auto writes: sizes, cp, batch sizes, the engine."""
    res, _ = resolve_on("llama3.1-8b", ["backend.name=fake"], 16, registry)
    lay = Layout("fake", "ddp_distopt", dp=2, tp=4, pp=2, vpp=2, micro_batch=2, micro_batches=8, profile=GENERIC)
    run = layout_config(res.config, lay)
    p, t = run.parallel, run.train
    assert (p.dp_replicate, p.dp_shard, p.tp, p.pp, p.vpp, p.cp) == (2, 1, 4, 2, 2, 1)
    assert p.distributed_optimizer and p.sequence_parallel and p.pp_schedule == "interleaved_1f1b"
    assert (t.micro_batch_size, t.global_batch_size, run.backend.name) == (2, 32, "fake")
    validate_config(run.model_dump(), world_size=16, registry=registry)
    # a recipe's own partial recompute (block, 11 layers) is not carried into a layout that recomputes otherwise
    partial, _ = resolve_on("llama3.1-8b", ["parallel.recompute=full", "parallel.recompute_method=block",
                                            "parallel.recompute_layers=11"], 16, registry)  # fmt: skip
    run = layout_config(partial.config, replace(lay, recompute="selective"))
    assert (run.parallel.recompute, run.parallel.recompute_method, run.parallel.recompute_layers) == (
        "selective", "uniform", None)  # fmt: skip
    validate_config(run.model_dump(), world_size=16, registry=registry)


# ------------------------------------------------------------------------------------- 3. headroom


def test_a_layout_must_leave_the_headroom_free(registry):
    """A layout at 95% of the usable memory, inside the ±10% the estimate is held to, is not recommended."""
    m = model_config("llama3.1-8b", registry)
    tight = best(candidates(m, Cluster(device("MI300X"), 1, 8), 8192, 1, None, GENERIC))
    # the device with the memory that puts that layout at 95% of its usable memory
    dev = device("MI300X", tight.memory.total / GIB / 0.95 / 0.9)
    full = Cluster(dev, 1, 8, headroom=0.0)
    kept = Cluster(dev, 1, 8)
    assert Cluster(dev, 1, 8, cal.HEADROOM).budget == pytest.approx(full.capacity * 0.9)
    assert best(candidates(m, full, 8192, 1, None, GENERIC)).layout == tight.layout  # it fills the device
    safe = best(candidates(m, Cluster(dev, 1, 8, cal.HEADROOM), 8192, 1, None, GENERIC))
    assert safe.layout != tight.layout and safe.memory.total <= 0.9 * kept.capacity
    assert cal.HEADROOM == cal.FIT_TOLERANCE == 0.10


def test_plan_shows_and_takes_the_headroom(cli_registry):
    args = ["llama3.1-8b", "train.seq_len=8192", "train.micro_batch_size=1", "--engine", "fake", "--device", "MI300X"]
    m = model_config("llama3.1-8b", cli_registry)
    tight = best(candidates(m, Cluster(device("MI300X"), 1, 8), 8192, 1, None, GENERIC))
    gib = f"{tight.memory.total / 0.95 / 0.9 / GIB:.3f}"
    run = _plan(*args, "--gpu-memory", gib)
    assert run.exit_code == 0, run.output
    usable = float(gib) * 0.9
    assert f"{usable:.0f} usable, ≤ {usable * 0.9:.0f} with 10% headroom" in run.output
    assert all(float(row["total"]) <= usable * 0.9 + 0.05 for row in _rows(run.output))
    assert f"recommended: {tight.layout.describe()}\n" not in run.output
    loose = _plan(*args, "--gpu-memory", gib, "--headroom", "0")
    assert "with 0% headroom" in loose.output and f"recommended: {tight.layout.describe()}\n" in loose.output


# ------------------------------------------------------------------------------------ 3. micro-batch


def test_each_layout_has_its_fastest_micro_batch(registry):
    m = model_config("llama3.1-8b", registry)
    cluster = Cluster(device("MI300X"), 1, 8, cal.HEADROOM)
    fixed = {_key(c): c for c in candidates(m, cluster, 8192, 1, 512, GENERIC) if c.runnable}
    searched = [c for c in candidates(m, cluster, 8192, (1, 2, 4, 8, 16), 512, GENERIC) if c.runnable]
    assert len({_key(c) for c in searched}) == len(searched)  # each layout once
    for c in searched:
        lay = c.layout
        assert lay.micro_batch * lay.micro_batches * lay.dp == 512  # within the global batch
        if _key(c) in fixed:
            assert c.time.total <= fixed[_key(c)].time.total * (1 + 1e-9)
    assert any(
        c.layout.micro_batch > 1 and c.time.total < fixed[_key(c)].time.total for c in searched if _key(c) in fixed
    )


def _key(c):
    lay = c.layout
    return (lay.dp_mode, lay.dp, lay.tp, lay.pp, lay.vpp, lay.recompute)


def test_the_configs_micro_batch_wins_a_tie(registry):
    """One device, nothing to overlap: every micro-batch is as fast; the config's is kept, the others not preferred."""
    m = model_config("tiny-llama", registry)
    cluster = Cluster(device("H100"), 1, 1, cal.HEADROOM)
    for first in (4, 1):
        [c] = [c for c in candidates(m, cluster, 128, (first, 1, 2, 4, 8), 64, GENERIC) if c.layout.recompute == "none"]
        assert c.layout.micro_batch == first


def test_plan_searches_the_micro_batch_unless_it_is_given(cli_registry):
    searched = _plan("llama3.1-8b", "train.seq_len=8192", "--engine", "fake", "--device", "MI300X")
    assert "micro-batch searched" in searched.output
    rows = _rows(searched.output)
    assert {"mbs"} <= set(rows[0]) and any(row["mbs"] != "1" for row in rows)
    given = _plan(
        "llama3.1-8b", "train.seq_len=8192", "train.micro_batch_size=1", "--engine", "fake", "--device", "MI300X"
    )
    assert "micro-batch fixed" in given.output and {row["mbs"] for row in _rows(given.output)} == {"1"}


# ----------------------------------------------------------------------------------------- 4. compile


def test_compile_shortens_the_estimated_step(registry):
    """torch.compile fuses the memory-bound work: the estimate takes COMPILE_MEMORY_BOUND_KEPT of it, nothing else."""
    m = model_config("llama3.1-8b", registry)
    lay = Layout("fake", "fsdp", dp=8, micro_batch=1, micro_batches=8, profile=GENERIC)
    eager = step_time(m, lay, 8192, 64, device("H200"), 8)
    compiled = step_time(m, lay, 8192, 64, device("H200"), 8, KernelTerms(compiled=True))
    assert compiled.compute < eager.compute and compiled.tp_comm == eager.tp_comm
    assert 0 < cal.COMPILE_MEMORY_BOUND_KEPT < 1


@pytest.mark.parametrize("name,measured", [("llama3.2-1b", 53819.7 / 49307.9), ("llama3.2-3b", 22298.9 / 20626.8)])
def test_compile_speedup_as_measured(registry, name, measured):
    """Primus's bf16 pairs on the H200 (eager: fp8_training.json; compiled: fp8_training_compiled_primus.json)."""
    from primus.core.planner.search import evaluate

    m = model_config(name, registry).model_copy(update={"tie_word_embeddings": False})
    cluster = Cluster(device("H200"), 1, 1)
    lay = Layout("fake", "ddp", 1, micro_batch=2, profile=GENERIC)
    eager, compiled = (
        evaluate(m, lay, 4096, 2, cluster, "bf16", KernelTerms(compiled=c)).tokens_per_s_per_device
        for c in (False, True)
    )
    assert compiled / eager == pytest.approx(measured, abs=0.02)


def test_plan_of_a_compiled_recipe(cli_registry):
    args = ["llama3.1-8b-torchtitan-fsdp", "train.micro_batch_size=1", "--engine", "fake", "--device", "MI300X"]
    compiled, eager = _plan(*args), _plan(*args, "train.compile=false")
    assert ", compiled" in compiled.output and ", compiled" not in eager.output
    fast = {row["layout"]: float(row["step"]) for row in _rows(compiled.output)}
    slow = {row["layout"]: float(row["step"]) for row in _rows(eager.output)}
    both = fast.keys() & slow.keys()
    assert both and all(fast[k] < slow[k] for k in both)
