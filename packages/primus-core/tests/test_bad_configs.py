"""A table of bad configs: each is refused, and the message names the key (and what is wrong)."""

from __future__ import annotations

import textwrap

import pytest

from primus.core.config.errors import ConfigError
from primus.core.config.loader import load_layers
from primus.core.config.presets import resolver
from primus.core.config.validate import validate_config

BASE = "extends: [tiny-llama]\nbackend: {name: fake}\n"

# (id, yaml body added to BASE (or a whole file when it has no 'extends'), overrides, world size,
#  expected key path, expected fragment of the message)
CASES = [
    ("wrong-type-int", "train: {steps: ten}", [], 1, "train.steps", "valid integer"),
    ("string-for-number", "train: {seq_len: '128'}", [], 1, "train.seq_len", "valid integer"),
    ("float-for-int", "model: {hidden_size: 128.5}", [], 1, "model.hidden_size", "valid integer"),
    ("wrong-type-bool", "train: {compile: 'yes'}", [], 1, "train.compile", "valid boolean"),
    ("negative-hidden", "model: {hidden_size: -128}", [], 1, "model.hidden_size", "greater than 0"),
    ("zero-layers", "model: {num_layers: 0}", [], 1, "model.num_layers", "greater than 0"),
    ("negative-lr", "train: {optimizer: {lr: -0.1}}", [], 1, "train.optimizer.lr", "greater than 0"),
    ("beta-out-of-range", "train: {optimizer: {beta2: 1.5}}", [], 1, "train.optimizer.beta2", "less than 1"),
    ("negative-micro-batch", "", ["train.micro_batch_size=-2"], 1, "train.micro_batch_size", "greater than 0"),
    (
        "heads-not-dividing-hidden",
        "model: {num_attention_heads: 3, num_kv_heads: 1}",
        [],
        1,
        "model.num_attention_heads",
        "does not divide model.hidden_size",
    ),
    ("kv-heads-not-dividing-heads", "model: {num_kv_heads: 3}", [], 1, "model.num_kv_heads", "does not divide"),
    ("unknown-top-key", "trian: {steps: 3}", [], 1, "trian", "did you mean 'train'"),
    ("unknown-model-key", "model: {hiden_size: 64}", [], 1, "model.hiden_size", "did you mean 'hidden_size'"),
    (
        "unknown-nested-key",
        "train: {optimizer: {learning_rate: 0.1}}",
        [],
        1,
        "train.optimizer.learning_rate",
        "unknown key",
    ),
    ("unknown-override-key", "", ["parallel.tensor_parallel=2"], 1, "parallel.tensor_parallel", "unknown key"),
    ("bad-literal-precision", "train: {precision: bf8}", [], 1, "train.precision", "'bf16', 'fp32' or 'fp16'"),
    ("bad-literal-recompute", "parallel: {recompute: some}", [], 1, "parallel.recompute", "'none', 'selective'"),
    ("bad-dp-shard", "parallel: {dp_shard: many}", [], 1, "parallel.dp_shard", "'auto'"),
    ("section-not-mapping", "train: 5", [], 1, "train", "mapping"),
    ("unknown-backend", "", ["backend.name=deepspeed"], 1, "backend.name", "unknown backend 'deepspeed'"),
    ("missing-known-backend", "", ["backend.name=megatron"], 1, "backend.name", "pip install primus-megatron"),
    ("unknown-kernel", "kernels: {attention: flashy}", [], 1, "kernels.attention", "unknown provider 'flashy'"),
    ("unknown-kernel-suggest", "kernels: {rms_norm: torhc}", [], 1, "kernels.rms_norm", "did you mean 'torch'"),
    ("bad-gemm-tuning", "kernels: {gemm_tuning: always}", [], 1, "kernels.gemm_tuning", "'off', 'online'"),
    ("unknown-strategy", "parallel: {strategy: fsdp3}", [], 1, "parallel.strategy", "did you mean 'fsdp2'"),
    ("product-not-world", "parallel: {tp: 2, pp: 2, dp_shard: 1}", [], 8, "parallel", "the world size is 8"),
    ("fixed-not-dividing-world", "parallel: {tp: 2, pp: 2}", [], 6, "parallel", "does not divide the world size 6"),
    ("tp-not-dividing-heads", "parallel: {tp: 3, dp_shard: 1}", [], 3, "parallel.tp", "must divide"),
    ("sp-without-tp", "parallel: {sequence_parallel: true}", [], 1, "parallel.sequence_parallel", "tp > 1"),
    (
        "gemm-tuning-with-fp8",
        "kernels: {gemm_tuning: offline, fp8: rowwise}",
        [],
        1,
        "kernels.gemm_tuning",
        "tunes bf16 GEMMs, and kernels.fp8=rowwise",
    ),
    ("fp8-unknown-mode", "kernels: {fp8: e4m3}", [], 1, "kernels.fp8", "'off', 'tensorwise' or 'rowwise'"),
    ("fp8-recipe-typo", "kernels: {fp8_recipe: {grad_dtype: e5m3}}", [], 1, "kernels.fp8_recipe.grad_dtype", "e5m2"),
    (
        "gemm-budget-zero",
        "kernels: {gemm_tuning_candidates: 0}",
        [],
        1,
        "kernels.gemm_tuning_candidates",
        "greater than 0",
    ),
    ("vpp-without-pp", "parallel: {vpp: 2}", [], 1, "parallel.vpp", "pp > 1"),
    (
        "interleaved-without-vpp",
        "parallel: {pp: 2, pp_schedule: interleaved_1f1b}",
        [],
        2,
        "parallel.pp_schedule",
        "vpp > 1",
    ),
    ("too-many-stages", "parallel: {pp: 2, vpp: 2}", [], 2, "parallel.pp", "exceeds model.num_layers 2"),
    (
        "recompute-layers-without-full",
        "parallel: {recompute_layers: 2}",
        [],
        1,
        "parallel.recompute_layers",
        "recompute: full",
    ),
    ("cp-seq-divisibility", "parallel: {cp: 2}\ntrain: {seq_len: 66}", [], 2, "train.seq_len", "2 × parallel.cp"),
    (
        "global-batch-not-multiple",
        "train: {global_batch_size: 7, micro_batch_size: 2}",
        [],
        2,
        "train.global_batch_size",
        "multiple",
    ),
    (
        "warmup-exceeds-steps",
        "train: {steps: 4, schedule: {warmup_steps: 10}}",
        [],
        1,
        "train.schedule.warmup_steps",
        "exceeds train.steps",
    ),
    ("min-lr-exceeds-lr", "train: {optimizer: {lr: 0.001, min_lr: 0.01}}", [], 1, "train.optimizer.min_lr", "exceeds"),
    ("seq-beyond-positions", "train: {seq_len: 4096}", [], 1, "train.seq_len", "max_position_embeddings"),
    (
        "rope-scaling-factors",
        "model: {rope_scaling: {low_freq_factor: 4.0, high_freq_factor: 1.0}}",
        [],
        1,
        "model.rope_scaling.high_freq_factor",
        "exceed",
    ),
    ("engine-refusal", "parallel: {cp: 2}", [], 2, "parallel.cp", "no context parallelism"),
    ("missing-env-var", "train: {steps: '${PRIMUS_TEST_UNSET_VAR}'}", [], 1, "train.steps", "PRIMUS_TEST_UNSET_VAR"),
    ("bad-override-syntax", "", ["train.steps"], 1, "train.steps", "key.sub=value"),
    ("bad-paths-type", "data: {paths: a.jsonl}", [], 1, "data.paths", "valid list"),
    ("bad-list-item", "profile: {ranks: [0, x]}", [], 1, "profile.ranks[1]", "valid integer"),
    (
        "logger-not-installed",
        "logging: {loggers: {wandb: {}}}",
        [],
        1,
        "logging.loggers.wandb",
        "primus-loggers[wandb]",
    ),
    ("unknown-logger", "logging: {loggers: {tensorwatch: {}}}", [], 1, "logging.loggers.tensorwatch", "no installed"),
    ("eval-without-data", "eval: {interval: 5}", [], 1, "eval.interval", "no evaluation data is named"),
    ("blend-odd", "data: {blend: [0.5, a.jsonl, 0.5]}", [], 1, "data.blend", "weight path pairs"),
    ("resume-word", "checkpoint: {resume: sometimes}", [], 1, "checkpoint.resume", "auto"),
]


def _load(tmp_path, registry, body: str, overrides: list[str], world: int):
    path = tmp_path / "exp.yaml"
    path.write_text(BASE + textwrap.dedent(body) + "\n")
    layers = load_layers(str(path), overrides, resolve_preset=resolver(registry), env={})
    return validate_config(layers.data, world_size=world, registry=registry)


def test_the_table_is_large_enough():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_config_is_refused_naming_the_key(tmp_path, registry, case):
    _, body, overrides, world, path, fragment = case
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, registry, body, overrides, world)
    err = info.value
    assert path in err.paths, f"expected key {path!r} in {err.paths}: {err}"
    issue = next(i for i in err.issues if i.path == path)
    assert fragment in str(issue), f"{fragment!r} not in {str(issue)!r}"


def test_extends_cycle(tmp_path, registry):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: [a.yaml]\n")
    with pytest.raises(ConfigError) as info:
        load_layers(str(tmp_path / "a.yaml"), resolve_preset=resolver(registry))
    assert info.value.paths == ["extends"] and "cycle: a.yaml -> b.yaml -> a.yaml" in str(info.value)


def test_extends_missing_parent(tmp_path, registry):
    (tmp_path / "a.yaml").write_text("extends: [nope.yaml]\n")
    with pytest.raises(ConfigError, match="no file or preset named 'nope.yaml'"):
        load_layers(str(tmp_path / "a.yaml"), resolve_preset=resolver(registry))


def test_unsafe_yaml_is_not_constructed(tmp_path, registry):
    (tmp_path / "evil.yaml").write_text("model: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_layers(str(tmp_path / "evil.yaml"), resolve_preset=resolver(registry))


def test_broken_yaml_names_the_file(tmp_path, registry):
    (tmp_path / "broken.yaml").write_text("train: {steps: 3\n")
    with pytest.raises(ConfigError) as info:
        load_layers(str(tmp_path / "broken.yaml"), resolve_preset=resolver(registry))
    assert str(tmp_path / "broken.yaml") in info.value.paths[0]


def test_all_problems_reported_at_once(tmp_path, registry):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, registry, "train: {steps: 0, seq_len: x}\nmodel: {vocab_size: -1}", [], 1)
    assert {"train.steps", "train.seq_len", "model.vocab_size"} <= set(info.value.paths)
