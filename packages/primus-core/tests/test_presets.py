"""Presets carry the published shapes: their parameter counts match the model cards."""

from __future__ import annotations

import pytest

from primus.core.config.loader import load_layers
from primus.core.config.presets import catalog, model_config, resolver
from primus.core.config.schema import ModelConfig, PrimusConfig
from primus.core.config.validate import validate_config
from primus.core.planner.modelmath import count_params, flops_per_token

# Published totals (model cards / config.json), in billions, with the rounding they are quoted at.
PUBLISHED = {
    "llama3.1-8b": 8.03,
    "llama3.1-70b": 70.6,
    "llama3.1-405b": 405.9,
    "llama3.2-1b": 1.24,
    "llama3.2-3b": 3.21,
    "qwen2.5-0.5b": 0.49,
    "qwen2.5-1.5b": 1.54,
    "qwen2.5-3b": 3.09,
    "qwen2.5-7b": 7.62,
    "qwen2.5-14b": 14.8,
    "qwen2.5-32b": 32.8,
    "qwen2.5-72b": 72.7,
    "qwen3-0.6b": 0.6,
    "qwen3-1.7b": 1.7,
    "qwen3-4b": 4.0,
    "qwen3-8b": 8.2,
    "qwen3-14b": 14.8,
    "qwen3-32b": 32.8,
    "mistral-7b-v0.3": 7.25,
    "qwen3-30b-a3b": 30.5,
    "qwen3-235b-a22b": 235.0,
    "mixtral-8x7b": 46.7,
    "deepseek-v3": 671.0,
    "deepseek-v2-lite": 15.7,
    "moonlight-16b-a3b": 16.0,  # its name; its card's 15.29B leaves the embeddings out (test_deepseek.py)
    "gpt-oss-120b": 116.83,  # OpenAI's model card; its breakdown and active count: test_gpt_oss.py
    "gpt-oss-20b": 20.91,
}
# Mixture-of-experts: the parameters a token runs through, as the model cards quote them ("A3B", "A22B"; Mixtral's
# 12.9B), embeddings included, with half a unit of the rounding they are quoted at (Qwen3-30B-A3B's card says 3.3B
# for the 3.353B its config gives: truncated, not rounded).
PUBLISHED_ACTIVE = {"qwen3-30b-a3b": (3.3, 0.06), "qwen3-235b-a22b": (22, 0.5), "mixtral-8x7b": (12.9, 0.05)}
# Non-embedding counts the Qwen cards also quote.
PUBLISHED_NON_EMBEDDING = {"qwen2.5-7b": 6.53, "qwen2.5-0.5b": 0.36, "qwen3-0.6b": 0.44, "qwen3-8b": 6.95}


def _model(registry, name: str) -> ModelConfig:
    return model_config(name, registry)


@pytest.mark.parametrize("name,billions", sorted(PUBLISHED.items()))
def test_param_count_matches_published(registry, name, billions):
    total = count_params(_model(registry, name)).total / 1e9
    digits = len(str(billions).split(".")[1])
    # the card rounds to `digits` decimals; allow half a unit of that rounding (and Qwen3's coarse 0.6/1.7)
    tol = 0.5 * 10**-digits + (0.05 if name.startswith("qwen3") else 0)
    assert abs(total - billions) <= tol, f"{name}: {total:.3f}B vs published {billions}B"


@pytest.mark.parametrize("name,published", sorted(PUBLISHED_ACTIVE.items()))
def test_active_params_match_published(registry, name, published):
    billions, tol = published
    p = count_params(_model(registry, name))
    assert abs(p.active / 1e9 - billions) <= tol, f"{name}: {p.active / 1e9:.3f}B active vs published {billions}B"
    assert p.moe_layers == _model(registry, name).num_layers  # every layer of these three is MoE


def test_moe_count_and_flops_formula(registry):
    """tiny-qwen3-moe by hand: each layer's MLP is 8 experts of 3·d·64 and a d×8 router; a token runs 2 experts;
    the FLOPs count what a token runs."""
    m = _model(registry, "tiny-qwen3-moe")
    d, expert = 128, 3 * 128 * 64
    attn = d * 4 * 64 + 2 * d * 2 * 64 + 4 * 64 * d
    norms = 2 * d + 2 * 64
    p = count_params(m)
    assert p.moe_layer == attn + norms + d * 8 + 8 * expert and p.moe_layer_active == attn + norms + d * 8 + 2 * expert
    assert p.total == 2 * 2048 * d + 2 * p.moe_layer + d
    assert p.active == p.total - 2 * 6 * expert
    assert flops_per_token(m, 64) == pytest.approx(6 * (p.active - 2048 * d) + 12 * 2 * 4 * 64 * 64)


def test_moe_layer_pattern():
    from primus.core.config.schema import MoEConfig

    moe = MoEConfig(first_dense_layers=3, layer_frequency=2)
    assert [i for i in range(10) if moe.is_moe_layer(i)] == [3, 5, 7, 9]
    m = ModelConfig(num_layers=10, moe={"first_dense_layers": 3, "layer_frequency": 2})
    dense = count_params(ModelConfig(num_layers=10))
    assert count_params(m).moe_layers == 4 and count_params(m).per_layer == dense.per_layer
    for n, first, every in ((1, 0, 1), (5, 5, 1), (6, 5, 3), (11, 2, 3), (12, 0, 4), (48, 3, 1)):
        pattern = MoEConfig(first_dense_layers=first, layer_frequency=every)
        assert pattern.num_moe_layers(n) == sum(map(pattern.is_moe_layer, range(n))), (n, first, every)


@pytest.mark.parametrize(
    ("moe", "key", "needle"),
    [
        ({"num_experts": 4, "experts_per_token": 5}, "model.moe.experts_per_token", "exceeds model.moe.num_experts 4"),
        ({"first_dense_layers": 2}, "model.moe.first_dense_layers", "leaves no MoE layer"),
        ({"num_experts": 8, "ep": 3}, "parallel.ep", "do not split model.moe.num_experts 8"),
        ({"num_experts": 8, "ep": 4}, "parallel.ep", "4 does not divide them"),  # 2 data-parallel ranks
        ({"ep": 2, "dense": True}, "parallel.ep", "the model has none"),
    ],
)
def test_moe_refusals(moe, key, needle):
    from primus.core.config.errors import ConfigError

    moe = dict(moe)
    ep, dense = moe.pop("ep", 1), moe.pop("dense", False)
    model = {"num_layers": 2, **({} if dense else {"moe": moe})}
    with pytest.raises(ConfigError) as info:
        validate_config({"model": model, "parallel": {"ep": ep}, "train": {"global_batch_size": 8}}, world_size=2)
    assert key in str(info.value) and needle in str(info.value)


@pytest.mark.parametrize("name,billions", sorted(PUBLISHED_NON_EMBEDDING.items()))
def test_non_embedding_params(registry, name, billions):
    m = _model(registry, name)
    p = count_params(m)
    non_emb = (p.total - p.embedding - p.output_head) / 1e9  # Qwen counts both embedding tables out
    assert abs(non_emb - billions) <= 0.01, f"{name}: {non_emb:.3f}B"


def test_exact_llama31_8b_breakdown(registry):
    p = count_params(_model(registry, "llama3.1-8b"))
    assert p.embedding == 128256 * 4096
    assert p.per_layer == 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert p.total == 8_030_261_248  # the figure transformers reports for Llama-3.1-8B


def test_flops_per_token_formula(registry):
    m = _model(registry, "llama3.1-8b")
    n = count_params(m).total - 128256 * 4096
    assert flops_per_token(m, 8192) == pytest.approx(6 * n + 12 * 32 * 4096 * 8192)
    tied = _model(registry, "llama3.2-1b")  # tied: the head GEMM still runs
    assert flops_per_token(tied, 4096) == pytest.approx(6 * count_params(tied).total + 12 * 16 * 2048 * 4096)


def test_every_preset_validates(registry):
    cat = catalog(registry)
    assert {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-demo"} <= set(cat)
    assert {n for n, p in cat.items() if p.kind == "model" and not n.startswith("tiny")} == set(PUBLISHED)
    for name, preset in cat.items():
        data = load_layers(str(preset.path), resolve_preset=resolver(registry)).data
        par = data.get("parallel", {})
        world = par.get("tp", 1) * par.get("pp", 1) * par.get("cp", 1)  # the smallest world the recipe tiles
        cfg = validate_config(data, world_size=world)
        assert isinstance(cfg, PrimusConfig), name
        assert cfg.model.name in cat, f"{name}: model.name {cfg.model.name!r} is not a preset"


def test_family_specific_shapes(registry):
    q25, q3, llama = _model(registry, "qwen2.5-7b"), _model(registry, "qwen3-0.6b"), _model(registry, "llama3.2-1b")
    assert q25.qkv_bias and not q25.qk_norm
    assert q3.qk_norm and not q3.qkv_bias and q3.kv_channels == 128 and q3.hidden_size == 1024  # 16·128 ≠ 1024
    assert llama.tie_word_embeddings and llama.rope_scaling is not None and llama.rope_scaling.factor == 32.0


def test_recipe_names_and_renamed_ones(registry, caplog):
    """A seed recipe is named <model>-<backend>-<layout> after what it holds (the demos excepted); a renamed one
    (renamed.yaml) still resolves to its new file, warns once naming the new name, and is not listed."""
    import logging

    from primus.core.config import presets
    from primus.core.config.presets import find, renamed

    presets._warned.discard("llama3.1-8b-fsdp")  # once a process: another test may have met it
    cat = catalog(registry)
    for name, p in cat.items():
        if p.kind != "recipe" or p.dist != "primus-core" or name in ("tiny-demo", "tiny-demo-megatron", "sft"):
            continue
        data = load_layers(str(p.path), resolve_preset=resolver(registry)).data
        assert name.startswith(f"{data['model']['name']}-{data['backend']['name']}-"), name
    old = renamed(registry)
    assert old["llama3.1-8b-fsdp"] == "llama3.1-8b-torchtitan-fsdp"
    assert set(old.values()) <= set(cat) and not set(old) & set(cat)
    with caplog.at_level(logging.WARNING, logger="primus.presets"):
        assert find("llama3.1-8b-fsdp", registry) == cat["llama3.1-8b-torchtitan-fsdp"]
        assert resolver(registry)("llama3.1-8b-fsdp") == cat["llama3.1-8b-torchtitan-fsdp"].path
    said = [r.getMessage() for r in caplog.records]
    assert said == ["preset llama3.1-8b-fsdp is now called llama3.1-8b-torchtitan-fsdp: the old name will be removed"]
    assert find("llama3.1-8b-nothing", registry) is None
