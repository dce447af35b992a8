"""What the torchtitan backend refuses before any work, and that the presets it can run pass."""

from __future__ import annotations

import pytest
from conftest import CONFIGS, TINY

from primus.core.config.errors import ConfigError
from primus.core.launch.resolve import resolve

MOE = ["model.family=qwen3", "model.qk_norm=true", "model.head_dim=64", "model.moe.num_experts=4"]
MOE += ["model.moe.balancing=loss_free", "train.init=engine"]
QWEN3 = ["model.family=qwen3", "model.qk_norm=true", "model.head_dim=64"]


def issues(config: str, *overrides: str, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(config, list(overrides), world_size)
    return str(err.value)


@pytest.mark.parametrize(
    ("overrides", "world_size", "key", "why"),
    [
        (["model.tie_word_embeddings=true", "parallel.pp=2"], 2, "parallel.pp", "first and last pipeline stages"),
        (
            ["model.family=qwen3", "model.tie_word_embeddings=true", "parallel.dp_shard=2"],
            2,
            "model.tie_word_embeddings",
            "two FSDP groups",
        ),
        (["model.family=qwen3", "model.qkv_bias=true"], 1, "model.qkv_bias", "qwen3 model has no qkv bias"),
        (["parallel.fsdp=false"], 2, "parallel.fsdp", "only with FSDP2"),
        (["model.moe.num_experts=4", "train.init=engine"], 1, "model.family", "builds mixture-of-experts layers in"),
        (MOE + ["model.moe.first_dense_layers=1"], 1, "model.moe.first_dense_layers", "every layer"),
        (MOE + ["model.moe.capacity_factor=1.5"], 1, "model.moe.capacity_factor", "drops no tokens"),
        (
            MOE
            + ["parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2"]
            + ["backend.extra.parallelism.expert_tensor_parallel_degree=1"],
            4,
            "backend.extra.parallelism.expert_tensor_parallel_degree",
            "torchtitan#2387",
        ),
        (["model.head_dim=64"], 1, "model.head_dim", "hidden_size / heads"),
        (["model.qk_norm=true"], 1, "model.qk_norm", "llama3 model has no qk_norm"),
        (["train.precision=fp16"], 1, "train.precision", "no fp16 loss scaling"),
        (["train.optimizer.name=sgd"], 1, "train.optimizer.name", "Adam and AdamW only"),
        (["train.precision=bf16", "parallel.tp=2"], 2, "train.precision", "silently train in fp32"),
        (
            ["parallel.dp_replicate=2", "parallel.tp=2", "parallel.dp_shard=1"],
            4,
            "parallel.dp_replicate",
            "cannot be combined with tp",
        ),
        (
            [
                "model.num_layers=4",
                "parallel.pp=2",
                "parallel.vpp=2",
                "parallel.pp_schedule=1f1b",
                "train.global_batch_size=8",
            ],
            2,
            "parallel.pp_schedule",
            "one stage per rank",
        ),
        (["parallel.pp=2", "parallel.pp_schedule=zero_bubble"], 2, "parallel.pp_schedule", "several stages per rank"),
        (["parallel.recompute=full", "parallel.recompute_layers=2"], 1, "parallel.recompute_layers", "every layer"),
        (["checkpoint.keep_last=1"], 1, "checkpoint.keep_last", "at least 2"),
        (["kernels.rope=triton"], 1, "kernels.rope", "interleaved pairs"),
        (
            ["model.family=qwen3", "model.qk_norm=true", "model.head_dim=64", "kernels.rope=triton"],
            1,
            "kernels.rope",
            "inline in its Attention.forward",
        ),
        (["kernels.rms_norm=triton", "parallel.tp=2"], 2, "kernels.rms_norm", "norms on DTensors"),
        (["kernels.cross_entropy=triton", "parallel.tp=2"], 2, "kernels.cross_entropy", "loss parallelism"),
        (["kernels.attention=flash", "parallel.cp=2"], 2, "kernels.attention", "context parallelism"),
        (
            ["parallel.cp=2", "backend.extra.parallelism.context_parallel_load_balancer=ptrr"],
            2,
            "backend.extra.parallelism.context_parallel_load_balancer",
            "head-tail shards",
        ),
        (["backend.extra.trainer.steps=3"], 1, "backend.extra.trainer", "not a section of torchtitan's JobConfig"),
        (
            ["backend.extra.checkpoint.initial_load_path=s"],
            1,
            "backend.extra.checkpoint.initial_load_path",
            "init_from",
        ),
        (
            ["backend.extra.checkpoint.create_seed_checkpoint=true"],
            1,
            "checkpoint.create_seed_checkpoint",
            "save_initial",
        ),
    ],
)
def test_refused_with_reason(overrides, world_size, key, why):
    text = issues(TINY, *overrides, world_size=world_size)
    assert key in text and why in text, text


@pytest.mark.parametrize(
    ("config", "world_size"),
    [
        ("tiny-demo", 1),
        (TINY, 2),
        ("tiny-qwen3", 1),
        ("tiny-mistral", 1),
        ("llama3.1-8b-torchtitan-fsdp", 8),
        ("llama3.1-70b-torchtitan-fsdp", 8),
        ("tiny-qwen2", 2),
        (str(CONFIGS / "tiny_moe.yaml"), 2),
        ("tiny-qwen3-moe", 1),  # auxiliary-loss balancing (primus.torchtitan.balancing), as every Qwen3-MoE preset
        ("qwen3-30b-a3b", 8),
        ("deepseek-v2-lite", 8),  # DeepSeek-V2's softmax router with its auxiliary loss
        ("llama3.2-1b-torchtitan-fsdp-h200-1x1", 8),  # primus-tune's recipe, when installed
    ],
)
def test_runnable_presets_pass(config, world_size):
    from primus.core.config.presets import catalog
    from primus.core.contracts.plugins import get_registry

    if not config.endswith(".yaml") and config not in catalog(get_registry()):
        pytest.skip(f"{config} comes from a plugin that is not installed here")
    overrides = ["backend.name=torchtitan"]
    res = resolve(config, overrides, world_size)
    assert res.config.backend.name == "torchtitan"


@pytest.mark.parametrize(
    ("overrides", "world_size"),
    [
        (MOE + ["model.moe.balancing=aux_loss"], 1),
        (MOE + ["model.moe.seq_aux_loss_coeff=1e-4"], 1),  # DeepSeek-V3's, beside loss-free balancing
        (MOE + ["model.moe.balancing=aux_loss", "model.moe.seq_aux_loss_coeff=1e-4", "parallel.tp=2"], 2),
        (MOE + ["model.moe.balancing=aux_loss", "parallel.cp=2", "parallel.ep=2"], 2),
        (MOE + ["model.moe.balancing=aux_loss", "model.num_layers=4", "parallel.pp=2"], 2),
    ],
)
def test_auxiliary_loss_balancing_passes_in_every_layout(overrides, world_size):
    """Refused until torchtitan had Primus's auxiliary losses (its 0.2.2 MoE has none); each layout trains one rank's
    curve with them (test_balancing.py)."""
    moe = resolve(TINY, overrides, world_size).config.model.moe
    assert moe.balancing == "aux_loss" or moe.seq_aux_loss_coeff > 0


@pytest.mark.parametrize(
    ("overrides", "world_size"),
    [
        (["kernels.rms_norm=triton", "kernels.swiglu=triton", "kernels.cross_entropy=triton"], 1),
        (["kernels.swiglu=triton", "kernels.attention=flash", "parallel.tp=2"], 2),  # local tensors under TP
        (["kernels.cross_entropy=triton", "parallel.tp=2", "backend.extra.parallelism.disable_loss_parallel=true"], 2),
        (["profile.enabled=true"], 1),
    ],
)
def test_kernel_providers_and_profiling_pass(overrides, world_size):
    assert resolve(TINY, overrides, world_size).config.kernels


def test_megatron_recipe_is_refused_naming_the_distributed_optimizer():
    text = issues("qwen2.5-7b-megatron-ddp", "backend.name=torchtitan", world_size=8)
    assert "parallel.distributed_optimizer" in text and "no distributed optimizer" in text


def test_context_parallel_runs_on_cpu_only_with_a_context_parallel_provider():
    """torch's own context-parallel SDPA needs a GPU; primus-turbo's ring attention (the provider's
    context-parallel entry point) runs on local shards, so the CPU takes cp > 1 with it."""
    from primus.torchtitan.validate import cpu_refusal

    cfg = resolve(TINY, ["parallel.cp=2"], 2).config
    assert "primus-turbo" in cpu_refusal(cfg, cp_attention=False)
    assert cpu_refusal(cfg, cp_attention=True) is None
    resolve(TINY, ["parallel.cp=2", "kernels.attention=ring"], 2)  # accepted
    resolve(TINY, ["parallel.cp=2", "kernels.attention=sdpa"], 2)  # torchtitan's module under torch's CP (GPU)


def test_gpt_oss_is_refused_by_name():
    """Family gpt_oss: one refusal at model.family, naming what is missing (torchtitan has the model, Primus's adapter
    does not build it); core says it in place of its generic "cannot run" line."""
    from primus.torchtitan.validate import validate

    cfg = resolve("tiny-gpt-oss", ["backend.name=torchtitan"], 1, check_plugins=False).config
    (issue,) = validate(cfg, world_size=1)
    assert (issue.path, issue.value) == ("model.family", "gpt_oss")
    assert "Primus's torchtitan adapter does not build torchtitan 0.2.2's gpt_oss model" in issue.message
    assert "Hugging Face import / export are not there yet" in issue.message
    said = issues("tiny-gpt-oss", "backend.name=torchtitan")
    assert said.count("model.family") == 1 and issue.message in " ".join(said.split()), said


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.attention_sinks=true", "model.attention_sinks"),
        ("model.sliding_window=64", "model.sliding_window"),
        ("model.rope_scaling={type: yarn, truncate: false}", "model.rope_scaling.truncate"),
    ],
)
def test_gpt_oss_parts_on_another_family_are_refused(override, key):
    said = issues(TINY, override)
    assert key in said and "torchtitan does not build it" in said, said
