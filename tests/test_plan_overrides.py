"""``primus plan`` says how to run each layout it ranks: the ``key=value`` words (its table's list and ``--json``'s
``overrides``) that, typed after the same config and words, are accepted (core's and the engine's validation at the
cluster's world size) and make the run it planned: the typed config's memory estimate is the layout's, to the byte.
Over every layout it shows for the seed recipes (core's presets/recipes, each on its own cluster) and a few presets
on both engines; and its recommendation is the layout ``parallel.strategy=auto`` picks for the same words on that
device (the micro-batch and global batch fixed by the words, as a run has them)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from primus.core.cli import app as cli
from primus.core.cli.plan import recipe_cluster
from primus.core.config.presets import catalog
from primus.core.contracts.plugins import get_registry
from primus.core.launch.resolve import resolve
from primus.core.planner import auto
from primus.core.planner.hardware import device
from primus.core.planner.memory import GIB
from primus.core.planner.strategies import estimate_memory

OVERRIDES = {"sft": ["data.source=chats.jsonl"]}  # what a recipe needs to be read at all (nothing is read to plan it)
PRESETS = [
    ("llama3.2-3b", ["backend.name=megatron", "train.seq_len=4096", "train.micro_batch_size=2"], "H100", 1, 1),
    ("llama3.1-8b", ["backend.name=megatron"], "H100", 8, 1),
    ("qwen3-30b-a3b", ["backend.name=megatron", "train.seq_len=4096"], "H200", 8, 1),
    ("moonlight-16b-a3b", ["backend.name=torchtitan", "train.seq_len=4096"], "H100", 8, 2),
]


def _seed_recipes() -> list[tuple[str, list[str], str, int, int]]:
    found = []
    for name, preset in sorted(catalog(get_registry()).items()):
        if preset.kind != "recipe" or preset.dist != "primus-core":
            continue
        c = recipe_cluster(name, OVERRIDES.get(name, []))
        found.append((name, OVERRIDES.get(name, []), (c and c.device) or "H100", c.gpus_per_node if c else 8,
                      c.nodes if c else 1))  # fmt: skip
    return found


CASES = _seed_recipes() + PRESETS


def _plan(config: str, words: list[str], dev: str, gpus: int, nodes: int) -> dict:
    args = ["plan", config, *words, "--device", dev, "--gpus", str(gpus), "--nodes", str(nodes), "--json"]
    res = CliRunner().invoke(cli.app, [*args, "--top", "1000"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_the_seed_recipes_are_all_here():
    assert {c[0] for c in _seed_recipes()} >= {"tiny-demo", "tiny-demo-megatron", "llama3.1-8b-torchtitan-fsdp"}


@pytest.mark.parametrize(
    ("config", "words", "dev", "gpus", "nodes"),
    CASES,
    ids=[" ".join([c[0], *c[1], c[2], str(c[3] * c[4])]) for c in CASES],
)
def test_every_layout_s_words_make_the_run_it_planned(config, words, dev, gpus, nodes):
    report = _plan(config, words, dev, gpus, nodes)
    world = gpus * nodes
    assert report["layouts"] and report["recommended"] == report["layouts"][0]
    for row in report["layouts"]:
        typed = [*words, *row["overrides"]]
        cfg = resolve(config, typed, world_size=world).config  # every validation; a refusal fails the test
        assert cfg.train.micro_batch_size == row["micro_batch"], (row["layout"], typed)
        got = estimate_memory(cfg, world).total / GIB
        assert got == pytest.approx(row["total_gib"], abs=1e-3), (row["layout"], typed)


@pytest.mark.parametrize(
    ("config", "words", "dev", "gpus"),
    [
        ("llama3.2-3b", ["backend.name=megatron", "train.seq_len=4096", "train.micro_batch_size=2"], "H100", 1),
        ("llama3.2-3b", ["backend.name=megatron", "train.seq_len=4096", "train.micro_batch_size=1"], "H200", 1),
        (
            "llama3.1-8b",
            ["backend.name=megatron", "train.seq_len=8192", "train.micro_batch_size=1", "train.global_batch_size=64"],
            "H100",
            8,
        ),
        (
            "qwen3-30b-a3b",
            ["backend.name=megatron", "train.seq_len=4096", "train.micro_batch_size=1", "train.global_batch_size=32"],
            "H200",
            8,
        ),  # fmt: skip
    ],
)
def test_the_recommendation_is_what_auto_picks(monkeypatch, config, words, dev, gpus):
    """The issue's case first: plan showed 23 layers of recompute where auto, on the GPU's own memory, picked 24."""
    report = _plan(config, words, dev, gpus, 1)
    best = report["recommended"]
    monkeypatch.setattr(auto, "local_device", lambda: device(dev))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(gpus))
    picked = resolve(config, [*words, "parallel.strategy=auto"], world_size=gpus).config
    typed = resolve(config, [*words, *best["overrides"]], world_size=gpus).config
    keys = ("dp_replicate", "tp", "pp", "vpp", "cp", "ep", "recompute", "recompute_method", "recompute_layers")
    assert {k: getattr(picked.parallel, k) for k in keys} == {k: getattr(typed.parallel, k) for k in keys}
    assert estimate_memory(picked, gpus).total / GIB == pytest.approx(best["total_gib"], abs=1e-3)


def test_bad_cluster_sizes_are_refused_naming_the_flag():
    for flag in ("--gpus", "--nodes"):
        res = CliRunner().invoke(cli.app, ["plan", "llama3.1-8b", flag, "0"])
        assert res.exit_code == 2 and flag in res.output, res.output
