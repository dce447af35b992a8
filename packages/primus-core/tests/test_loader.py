"""YAML layering: extends order, relative paths, ${VAR} substitution, typed overrides, provenance."""

from __future__ import annotations

from primus.core import hookimpl
from primus.core.config.loader import RECIPE_NAME, load_layers
from primus.core.config.presets import resolver
from primus.core.config.validate import validate_config
from primus.core.contracts.plugins import Registry, build_plugin_manager
from primus.core.launch.resolve import configure_changes, resolve


def test_extends_order_and_relative_paths(tmp_path, registry):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "base.yaml").write_text("extends: [tiny-llama]\ntrain: {steps: 5, seq_len: 64}\n")
    (sub / "lr.yaml").write_text("train: {optimizer: {lr: 1.0e-3}, steps: 6}\n")
    (tmp_path / "exp.yaml").write_text("extends: [sub/base.yaml, sub/lr.yaml]\ntrain: {seq_len: 32}\n")
    layers = load_layers(str(tmp_path / "exp.yaml"), resolve_preset=resolver(registry))
    cfg = validate_config(layers.data)
    assert (cfg.train.steps, cfg.train.seq_len, cfg.train.optimizer.lr) == (6, 32, 1e-3)
    assert cfg.model.hidden_size == 128  # from the preset
    src = layers.sources
    assert src["model.hidden_size"] == "preset models/tiny-llama"
    assert src["train.steps"].endswith("lr.yaml") and src["train.seq_len"].endswith("exp.yaml")


def test_the_run_folder_is_named_for_the_recipe_or_file_run(tmp_path, registry):
    def folder(config, *overrides):
        layers = load_layers(config, overrides, resolve_preset=resolver(registry))
        return layers.data["logging"]["output_dir"], layers.sources["logging.output_dir"]

    # one model, two recipes: two folders (they collided in outputs/tiny-llama)
    assert folder("tiny-demo") == ("outputs/tiny-demo", RECIPE_NAME)
    assert folder("tiny-demo-megatron")[0] == "outputs/tiny-demo-megatron"
    (tmp_path / "mine.yaml").write_text("extends: [tiny-demo]\n")  # the file run, not the recipe it extends
    assert folder(str(tmp_path / "mine.yaml"))[0] == "outputs/mine"
    assert folder("tiny-demo", "logging.output_dir=/tmp/r") == ("/tmp/r", "command line")
    (tmp_path / "set.yaml").write_text("extends: [tiny-demo]\nlogging: {output_dir: runs/a}\n")
    value, source = folder(str(tmp_path / "set.yaml"))
    assert value == "runs/a" and source.endswith("set.yaml")  # the file's layer (its path as the loader names it)


def test_env_substitution_keeps_types(tmp_path, registry):
    (tmp_path / "e.yaml").write_text(
        "extends: [tiny-llama]\ntrain: {steps: '${STEPS}', seq_len: '${SEQ:48}'}\n"
        "logging: {output_dir: '${ROOT:/tmp}/runs/${NAME}'}\n"
    )
    env = {"STEPS": "9", "NAME": "x"}
    layers = load_layers(str(tmp_path / "e.yaml"), resolve_preset=resolver(registry), env=env)
    cfg = validate_config(layers.data)
    assert cfg.train.steps == 9 and cfg.train.seq_len == 48 and cfg.logging.output_dir == "/tmp/runs/x"


def test_overrides_are_coerced_to_field_types(tmp_path, registry):
    layers = load_layers(
        "tiny-llama",
        [
            "train.optimizer.lr=1e-3",
            "model.head_dim=null",
            "train.steps=8",
            "data.paths=[a.jsonl, b.txt]",
            "parallel.dp_shard=auto",
            "train.compile=true",
            "model.rope_theta=500000",
            "backend.extra.foo.bar=3",
        ],
        resolve_preset=resolver(registry),
    )
    cfg = validate_config(layers.data)
    assert cfg.train.optimizer.lr == 1e-3 and isinstance(cfg.train.optimizer.lr, float)
    assert cfg.model.head_dim is None and cfg.train.steps == 8 and cfg.train.compile is True
    assert cfg.data.paths == ["a.jsonl", "b.txt"] and cfg.parallel.dp_shard == "auto"
    assert cfg.model.rope_theta == 500000.0 and cfg.backend.extra == {"foo": {"bar": 3}}
    assert layers.sources["train.steps"] == "command line"


def test_yaml_floats_in_exponent_form(tmp_path, registry):
    (tmp_path / "f.yaml").write_text("extends: [tiny-llama]\ntrain: {optimizer: {lr: 3e-4, min_lr: 1e-5}}\n")
    cfg = validate_config(load_layers(str(tmp_path / "f.yaml"), resolve_preset=resolver(registry)).data)
    assert cfg.train.optimizer.lr == 3e-4 and cfg.train.optimizer.min_lr == 1e-5


def test_override_replaces_a_whole_subtree_source(registry):
    layers = load_layers("tiny-llama", ["model.rope_scaling={factor: 2.0}"], resolve_preset=resolver(registry))
    assert layers.sources["model.rope_scaling.factor"] == "command line"
    cfg = validate_config(layers.data)
    assert cfg.model.rope_scaling.factor == 2.0 and cfg.model.rope_scaling.type == "llama3"


class TuneLike:
    @staticmethod
    @hookimpl
    def primus_configure(config):
        if config.get("kernels", {}).get("gemm_tuning") == "offline":
            return {"kernels.gemm_tuning_file": "/cache/gemm.json"}
        return None


def test_configure_hook_changes_are_attributed(tmp_path):
    reg = Registry(build_plugin_manager(extra_plugins=[("tune-like", TuneLike)]))
    layers = load_layers(
        "tiny-llama", ["kernels.gemm_tuning=offline"], resolve_preset=resolver(reg), configure=configure_changes(reg)
    )
    assert layers.data["kernels"]["gemm_tuning_file"] == "/cache/gemm.json"
    assert layers.sources["kernels.gemm_tuning_file"] == "plugin tune-like"


def test_resolve_fills_auto_parallel(registry):
    res = resolve(
        "tiny-llama",
        ["backend.name=fake", "parallel.tp=2", "train.micro_batch_size=3"],
        world_size=8,
        registry=registry,
    )
    p = res.config.parallel
    assert (p.tp, p.dp_shard, p.dp_replicate) == (2, 4, 1)
    assert res.config.train.global_batch_size == 12  # micro batch × data-parallel size
