"""The backend is registered, and refuses what megatron-core cannot combine, naming the key."""

from __future__ import annotations

import pytest
from megatron_helpers import TINY

from primus.core.config.errors import ConfigError
from primus.core.contracts.plugins import get_registry
from primus.core.contracts.protocols import load_ref
from primus.core.launch.resolve import resolve
from primus.megatron.validate import validate


def test_backend_registered():
    spec = get_registry(refresh=True).backends["megatron"]
    assert spec.dist == "primus-megatron"
    assert spec.model_families == {"llama", "qwen2", "qwen3", "mistral", "deepseek"}
    assert load_ref(spec.engine).__module__ == "primus.megatron.engine"


def test_tiny_config_is_accepted():
    res = resolve(TINY, [], world_size=4)
    assert res.config.backend.name == "megatron"
    assert validate(res.config, world_size=4) == []
    fsdp = ["parallel.fsdp=true", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.recompute=full"]
    assert validate(resolve(TINY, fsdp, world_size=4).config, world_size=4) == []


def test_profiling_health_and_fault_injection_are_accepted():
    overrides = [
        "profile.enabled=true",
        "profile.ranks=[0,1]",
        "train.health.on_nonfinite=skip",
        "backend.extra.fault_injection.nan_at_step=3",
        "backend.extra.fault_injection.kill_during_save_at_step=4",
    ]
    assert validate(resolve(TINY, overrides, world_size=2).config, world_size=2) == []


@pytest.mark.parametrize(
    ("overrides", "world", "path", "needle"),
    [
        (["parallel.cp=2", "kernels.attention=sdpa"], 2, "kernels.attention", "no context_parallel feature"),
        (["parallel.cp=2", "parallel.fsdp=true", "train.global_batch_size=8"], 4, "parallel.cp", "FSDP2 with context"),
        (["parallel.pp=2", "parallel.pp_schedule=gpipe"], 2, "parallel.pp_schedule", "no gpipe schedule"),
        (["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=1f1b"], 2, "parallel.pp_schedule", "interleaved"),
        (
            ["parallel.pp=2", "parallel.vpp=2", "backend.extra.transformer_config.batch_p2p_comm=true"],
            2,
            "backend.extra.transformer_config.batch_p2p_comm",
            "swaps activations",
        ),
        (["parallel.pp=3"], 3, "model.num_layers", "do not split evenly"),
        (["backend.extra.fsdp=true"], 2, "backend.extra.fsdp", "parallel.fsdp: true"),
        (["backend.extra.seed_checkpoint=seed"], 1, "backend.extra.seed_checkpoint", "train.save_initial (write"),
        (["parallel.fsdp=true", "parallel.dp_replicate=2", "parallel.dp_shard=2"], 4, "parallel.dp_replicate", "HSDP"),
        (["parallel.fsdp=true", "parallel.overlap_param_gather=true"], 2, "parallel.overlap_param_gather", "prefetch"),
        (["parallel.fsdp=true", "kernels.fp8=tensorwise"], 2, "kernels.fp8", "FSDP2-sharded"),
        (["parallel.fsdp=true", "train.global_batch_size=6"], 3, "parallel.dp_shard", "even dp_shard"),
        (["parallel.fsdp=true", "model.ffn_hidden_size=353"], 4, "model.ffn_hidden_size", "706 rows"),
        (["parallel.fsdp=true", "parallel.distributed_optimizer=true"], 2, "parallel.distributed_optimizer", "already"),
        (["parallel.overlap_param_gather=true"], 1, "parallel.overlap_param_gather", "distributed_optimizer"),
        (
            ["parallel.recompute=full", "parallel.recompute_method=block", "parallel.recompute_layers=5"],
            1,
            "parallel.recompute_layers",
            "exceeds",
        ),
        (["train.precision=fp16"], 1, "train.precision", "loss scaling"),
        (
            ["model.moe.num_experts=4", "train.precision=bf16", "kernels.fp8=rowwise", "kernels.grouped_gemm=torch"],
            1,
            "kernels.grouped_gemm",
            "stacked expert weights",
        ),
        (["model.moe.num_experts=4", "model.moe.balancing=loss_free"], 1, "model.moe.balancing", "sigmoid router"),
        (["model.moe.num_experts=4", "parallel.tp=2"], 2, "parallel.sequence_parallel", "only with sequence parallel"),
        (
            [
                "model.moe.num_experts=4",
                "model.moe.seq_aux_loss_coeff=1e-4",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ],
            2,
            "model.moe.seq_aux_loss_coeff",
            "another curve than one rank",
        ),
        (
            ["model.moe.num_experts=4", "model.moe.seq_aux_loss_coeff=1e-4", "parallel.cp=2"],
            2,
            "seq_aux_loss_coeff",
            "CP",
        ),
        (["model.moe.num_experts=4", "parallel.fsdp=true", "parallel.dp_shard=2"], 2, "parallel.fsdp", "save hangs"),
        (["model.moe.num_experts=4", "kernels.moe_permute=triton"], 1, "kernels.moe_permute", "token dispatcher"),
        (["model.moe.num_experts=4", "kernels.moe_router=triton"], 1, "kernels.moe_router", "TopKRouter"),
        (["train.compile=true"], 1, "train.compile", "torch.compile"),
        (["backend.extra.bogus=1"], 1, "backend.extra", "bogus"),
        (["data.format=megatron"], 1, "data.source", ".bin/.idx"),
        (["backend.extra.fault_injection.nan_at=3"], 1, "backend.extra.fault_injection", "unknown key nan_at"),
        (["backend.extra.fault_injection.nan_at_step=x"], 1, "backend.extra.fault_injection", "must be an integer"),
    ],
)
def test_refusals(overrides, world, path, needle):
    with pytest.raises(ConfigError) as info:
        resolve(TINY, overrides, world_size=world)
    text = str(info.value)
    assert path in text and needle in text, text


def test_latent_attention_under_tp_needs_sequence_parallel():
    """Multi-head latent attention under TP: megatron-core sums the decoupled RoPE key's gradient over the
    tensor-parallel ranks only in its sequence-parallel gather; without SP it is refused by name (a dense MLA model:
    an MoE one is refused for SP already), with SP accepted."""
    with pytest.raises(ConfigError) as info:
        resolve("tiny-deepseek", ["backend.name=megatron", "model.moe=null", "parallel.tp=2"], world_size=2)
    assert "parallel.sequence_parallel" in str(info.value) and "RoPE key" in str(info.value), str(info.value)
    sp = ["backend.name=megatron", "parallel.tp=2", "parallel.sequence_parallel=true"]
    assert resolve("tiny-deepseek", sp, world_size=2).config.parallel.tp == 2


@pytest.mark.parametrize(
    ("overrides", "world", "key", "needle"),
    [(["model.mtp.layers=1", "data.document_mask=true"], 1, "data.document_mask", "rolls the tokens")],
)
def test_multi_token_prediction_refusals(overrides, world, key, needle):
    """model.mtp on megatron: document masks (the tokens roll, the document ids do not) are refused by name."""
    with pytest.raises(ConfigError) as info:
        resolve("tiny-deepseek", ["backend.name=megatron", *overrides], world_size=world)
    assert key in str(info.value) and needle in str(info.value), str(info.value)


def test_gpt_oss_is_refused_by_name():
    """Family gpt_oss: one refusal at model.family, naming what the local layer spec lacks (no other issue: they would
    be about a model megatron does not build); core says it in place of its generic "cannot run" line."""
    cfg = resolve("tiny-gpt-oss", ["backend.name=megatron"], world_size=1, check_plugins=False).config
    (issue,) = validate(cfg, world_size=1)
    assert (issue.path, issue.value) == ("model.family", "gpt_oss")
    assert "attention sinks" in issue.message and "sliding-window attention" in issue.message
    assert "Hugging Face import / export are not there yet" in issue.message
    assert issue.allowed == "deepseek, llama, mistral, qwen2, qwen3"
    with pytest.raises(ConfigError) as info:
        resolve("tiny-gpt-oss", ["backend.name=megatron"], world_size=1)
    assert [i.message for i in info.value.issues] == [issue.message]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.attention_sinks=true", "model.attention_sinks"),
        ("model.sliding_window=64", "model.sliding_window"),
        ("model.attention_out_bias=true", "model.attention_out_bias"),
        ("model.swiglu_limit=7.0", "model.swiglu_limit"),
    ],
)
def test_gpt_oss_parts_on_another_family_are_refused(override, key):
    with pytest.raises(ConfigError) as info:
        resolve(TINY, [override], world_size=1)
    assert key in str(info.value) and "megatron does not build it" in str(info.value), str(info.value)
