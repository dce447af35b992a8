"""``primus plan`` on the in-tree engines (issue 22): every layout it recommends is one the engine's backend accepts
(its own validation, ``BackendSpec.validate``), over every preset, H100 / H200 / MI300X, both engines (each where it is
installed); megatron is never planned with FSDP (its ``dp_shard > 1`` is the distributed optimizer); a recipe with fixed
sizes is planned at the cluster's world size; a layout inside the estimate's error band of the memory is not
recommended. Core's side, engine-free: primus-core's tests/test_planner_findings.py."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from primus.core.cli import app as cli
from primus.core.config.presets import catalog
from primus.core.config.validate import validate_config
from primus.core.contracts.engine import validate_with
from primus.core.contracts.plugins import get_registry
from primus.core.launch.cluster_plan import global_batch, rank, resolve_on
from primus.core.launch.resolve import searched_micro_batches
from primus.core.planner import Cluster, device
from primus.core.planner.auto import layout_config
from primus.core.planner.calibration import HEADROOM
from primus.core.planner.engine_profile import backend_spec

ENGINES = ("megatron", "torchtitan")
DEVICES = ("H100", "H200", "MI300X")
SHOWN = 10  # the layouts `primus plan` shows by default: each is one it recommends
# what a preset needs to be read at all (nothing is read to plan it)
OVERRIDES = {"sft": ["data.source=chats.jsonl"]}


def _engine(name: str):
    spec = backend_spec(name)
    if spec is None or spec.validate is None:
        pytest.skip(f"backend {name!r} is not installed")
    return spec


def _plan(*args: str):
    return CliRunner().invoke(cli.app, ["plan", *args])


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one line per layout


def _recommended(output: str) -> str:
    return next(ln for ln in output.splitlines() if ln.startswith("recommended: ")).removeprefix("recommended: ")


@pytest.mark.parametrize("engine", ENGINES)
def test_every_recommended_layout_runs_on_its_backend(engine):
    spec = _engine(engine)
    registry = get_registry()
    planned, presets = 0, sorted(catalog(registry))
    resolved = {name: resolve_on(name, OVERRIDES.get(name, []), 8, registry)[0] for name in presets}
    # a model the backend cannot build at all (its validation refuses model.family: GPT-OSS) is planned, and none of
    # its layouts is recommended
    unbuilt = {n for n in presets if any(i.path == "model.family" for i in validate_with(spec, resolved[n].config, 8))}
    for name in presets:
        res = resolved[name]
        for dev in DEVICES:
            cluster = Cluster(device(dev), 1, 8, HEADROOM)
            ranked = rank(res.config, cluster, engine, registry, searched_micro_batches(res), global_batch(res))
            shown = [c for c in ranked if c.runnable][:SHOWN]
            if name in unbuilt:
                assert ranked and not shown, f"{name} on 8 {dev}, {engine}: a layout of a model it cannot build"
                continue
            planned += bool(shown)
            for c in shown:
                where = f"{name} on 8 {dev}, {engine}: {c.layout.describe()}, micro-batch {c.layout.micro_batch}"
                run = layout_config(res.config, c.layout)
                assert validate_with(spec, run, 8) == [], where
                validate_config(run.model_dump(), world_size=8, registry=registry)  # core's checks and the backend's
                assert c.memory.total <= cluster.budget, where
                if engine == "megatron":  # what it runs: FSDP2 where the label says FSDP, else whole weights
                    fsdp = c.layout.dp_mode == "fsdp" and c.layout.dp > 1
                    assert run.parallel.fsdp is fsdp or not fsdp and run.parallel.dp_shard == 1, where
                    assert ("FSDP" in c.layout.describe()) is fsdp, where
    assert planned >= len(presets) - len(unbuilt)  # not vacuous: most presets have layouts on most devices
    assert {"gpt-oss-20b", "gpt-oss-120b", "tiny-gpt-oss"} <= unbuilt  # and the skip is not: no engine builds these


def test_megatron_fsdp_layouts_are_fsdp2():
    """The planner recommended "FSDP 4, TP 2+SP" on megatron when megatron refused FSDP and ran dp_shard 4 as the
    distributed optimizer (whole weights and gradients on every replica: a layout that did not fit). With FSDP2 under
    megatron (parallel.fsdp: true) 70B fits one 8-GPU node, and the FSDP it recommends is the FSDP the config asks for."""
    _engine("megatron")
    one = _plan("llama3.1-70b-torchtitan-fsdp", "--engine", "megatron", "--device", "MI300X")
    assert one.exit_code == 0, one.output
    assert _recommended(one.output).startswith("FSDP ") and "full recompute" in _recommended(one.output)
    registry = get_registry()
    res, _ = resolve_on("llama3.1-70b-torchtitan-fsdp", ["backend.name=megatron"], 8, registry)
    cluster = Cluster(device("MI300X"), 1, 8, HEADROOM)
    best = next(c for c in rank(res.config, cluster, "megatron", registry, searched_micro_batches(res)) if c.runnable)
    assert best.layout.describe() == _recommended(one.output)
    assert layout_config(res.config, best.layout).parallel.fsdp is True


def test_the_405b_recipe_is_planned_on_the_cluster():
    _engine("megatron")
    seven = _plan("llama3.1-405b-megatron-tp-pp-vpp", "--device", "MI300X", "--gpus", "8", "--nodes", "7")
    assert seven.exit_code == 0, seven.output
    assert "note: the config's own layout" not in seven.output and "PP 7" in _recommended(seven.output)
    assert "DDP 1, TP 8+SP, PP 7" in seven.output  # the recipe's own layout, ranked below FSDP2 ones
    # 64 devices: its own layout (56) does not tile them, every layout is planned; megatron splits the 126 layers
    # evenly only (the pipelines of 4, 8 and 16 chunks are left out, named) and shards the rest with FSDP2
    eight = _plan("llama3.1-405b-megatron-tp-pp-vpp", "--device", "MI300X", "--gpus", "8", "--nodes", "8")
    assert "world size 1" not in eight.output and "56 does not divide the world size 64" in eight.output
    assert eight.exit_code == 0 and "megatron refuses them: model.num_layers" in eight.output
    assert _recommended(eight.output).startswith("FSDP 4, TP 8+SP, PP 2")


def test_a_layout_inside_the_error_band_is_not_recommended():
    """llama3.1-8b-torchtitan-fsdp on 1×8 MI300X recommended DDP at 169.4 of 173 usable GiB, inside the ±10% the
    estimate is held to; with the headroom it takes a layout with that much free, and the micro-batch it is fastest
    with."""
    _engine("torchtitan")
    run = _plan("llama3.1-8b-torchtitan-fsdp", "--device", "MI300X")
    assert run.exit_code == 0, run.output
    assert "≤ 156 with 10% headroom" in run.output and _recommended(run.output) != "DDP 8, no recompute"
    tight = _plan("llama3.1-8b-torchtitan-fsdp", "--device", "MI300X", "--headroom", "0", "train.micro_batch_size=1")
    assert _recommended(tight.output) == "DDP 8, no recompute"  # what it was: the layout the headroom leaves out
