"""GPT-OSS (family gpt_oss) in core: the presets' counts against OpenAI's model card, the parts' count by hand, the
sliding window's FLOPs, and the config rules of its parts. No engine builds it yet (tests/test_gpt_oss_engines.py)."""

from __future__ import annotations

import pytest

from primus.core.config.errors import ConfigError
from primus.core.config.presets import model_config
from primus.core.config.schema import ModelConfig
from primus.core.config.validate import validate_config
from primus.core.planner.modelmath import count_params, expert_params, flops_per_token, matmul_params

# OpenAI's gpt-oss model card (Table 1), in billions: MLP, attention, embed + unembed, active, total. Its "active"
# counts the unembedding and not the embedding (a lookup): what matmul_params counts.
CARD = {
    "gpt-oss-120b": {"mlp": 114.71, "attention": 0.96, "embed_unembed": 1.16, "active": 5.13, "total": 116.83},
    "gpt-oss-20b": {"mlp": 19.12, "attention": 0.64, "embed_unembed": 1.16, "active": 3.61, "total": 20.91},
}


def _breakdown(m: ModelConfig) -> dict[str, float]:
    p = count_params(m)
    d, h, k, c, e = m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.kv_channels, m.moe
    attention = d * h * c + h * c + 2 * (d * k * c + k * c) + h * c * d + d + h  # q, k, v, o with biases; sinks
    mlp = e.num_experts * expert_params(m) + d * e.num_experts + e.num_experts  # experts, router and its bias
    return {
        "mlp": m.num_layers * mlp / 1e9,
        "attention": m.num_layers * attention / 1e9,
        "embed_unembed": (p.embedding + p.output_head) / 1e9,
        "active": matmul_params(m) / 1e9,
        "total": p.total / 1e9,
    }


@pytest.mark.parametrize("name", sorted(CARD))
def test_counts_within_one_percent_of_the_model_card(registry, name):
    m = model_config(name, registry)
    ours = _breakdown(m)
    for key, published in CARD[name].items():
        assert ours[key] == pytest.approx(published, rel=0.01), f"{name} {key}: {ours[key]:.3f}B vs {published}B"
    p = count_params(m)  # the parts add up to the planner's total (norms: 2·d a layer and the final one)
    norms = (2 * m.num_layers + 1) * m.hidden_size
    assert p.total == pytest.approx((ours["mlp"] + ours["attention"] + ours["embed_unembed"]) * 1e9 + norms, abs=1)
    assert p.active - p.embedding == matmul_params(m)  # untied: the card's active is the planner's, less the lookup


def test_tiny_count_by_hand(registry):
    """tiny-gpt-oss: 4 layers, d 128, 4 heads of 32 (2 KV), 8 experts of 64 with biases, 2 a token."""
    m = model_config("tiny-gpt-oss", registry)
    d, c, E, f = 128, 32, 8, 64
    attn = d * 4 * c + 4 * c + 2 * (d * 2 * c + 2 * c) + 4 * c * d + d + 4  # + o bias + 4 sinks
    expert = 3 * d * f + 2 * f + d
    always = attn + 2 * d + d * E + E  # norms, router and its bias
    p = count_params(m)
    assert expert_params(m) == expert
    assert (p.moe_layers, p.moe_layer, p.moe_layer_active) == (4, always + E * expert, always + 2 * expert)
    assert p.total == 2 * 2048 * d + 4 * p.moe_layer + d
    assert p.active == p.total - 4 * (E - 2) * expert


def test_sliding_layers_attend_to_the_window_only(registry):
    """Half the layers (the even ones) attend to 16 keys, not the sequence: the attention FLOPs count it."""
    m = model_config("tiny-gpt-oss", registry)
    assert [m.is_sliding_layer(i) for i in range(4)] == [True, False, True, False]
    attention = 12 * 4 * 32 * (2 * 512 + 2 * 16)  # 2 full layers over 512 keys, 2 sliding over 16
    assert flops_per_token(m, 512) == pytest.approx(6 * matmul_params(m) + attention)
    full = m.model_copy(update={"sliding_window": None, "sliding_layers": "all"})
    assert flops_per_token(full, 512) == pytest.approx(6 * matmul_params(m) + 12 * 4 * 4 * 32 * 512)
    short = flops_per_token(m, 8)  # shorter than the window: every layer attends to the whole sequence
    assert short == pytest.approx(6 * matmul_params(m) + 12 * 4 * 4 * 32 * 8)
    every = m.model_copy(update={"sliding_layers": "all"})
    assert all(every.is_sliding_layer(i) for i in range(4))


def test_existing_counts_are_unchanged(registry):
    """The new parts default off: other presets count as before them (the figures the planner gave then)."""
    for name, total, active in (
        ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),
        ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
        ("deepseek-v3", 671_026_419_200, 37_552_297_472),
    ):
        p = count_params(model_config(name, registry))
        assert (p.total, p.active) == (total, active), name
    m = model_config("qwen3-30b-a3b", registry)
    assert flops_per_token(m, 4096) == pytest.approx(27_914_883_072.0)


def test_presets_carry_the_published_shape(registry):
    big, small = model_config("gpt-oss-120b", registry), model_config("gpt-oss-20b", registry)
    for m in (big, small):
        assert m.family == "gpt_oss" and m.attention_sinks and m.qkv_bias and m.attention_out_bias
        assert (m.sliding_window, m.sliding_layers, m.swiglu_limit) == (128, "even", 7.0)
        assert m.moe is not None and m.moe.router_bias and m.moe.expert_bias and m.moe.experts_per_token == 4
        rs = m.rope_scaling
        assert rs is not None and (rs.type, rs.factor, rs.original_max_position_embeddings, rs.truncate) == (
            "yarn",
            32.0,
            4096,
            False,
        )
    assert (big.num_layers, big.moe.num_experts, small.num_layers, small.moe.num_experts) == (36, 128, 24, 32)


@pytest.mark.parametrize(
    ("model", "key", "needle"),
    [
        ({"sliding_layers": "even"}, "model.sliding_layers", "there is no window"),
        ({"sliding_window": 2048}, "model.sliding_window", "as long as the context"),
        ({"family": "gpt_oss"}, "model.moe", "every GPT-OSS MLP is a mixture of experts"),
    ],
)
def test_nonsense_is_refused(model, key, needle):
    with pytest.raises(ConfigError) as info:
        validate_config({"model": {"num_layers": 2, **model}})
    assert key in str(info.value) and needle in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("model", "key"),
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"swiglu_limit": -1.0}, "swiglu_limit"),
        ({"sliding_layers": "odd"}, "sliding_layers"),
    ],
)
def test_out_of_range_values_are_refused(model, key):
    with pytest.raises(ConfigError) as info:
        validate_config({"model": model})
    assert key in str(info.value), str(info.value)


def test_hugging_face_side_refuses_it_by_name(registry):
    """Import / export of GPT-OSS is not mapped yet: both directions say so, naming the key; a GPT-OSS part on
    another family is not written as if it were absent."""
    from primus.core.hf.config import HFConfigError, hf_config, model_fields_from_hf

    with pytest.raises(HFConfigError, match="model.family 'gpt_oss' has no Hugging Face mapping yet"):
        hf_config(model_config("tiny-gpt-oss", registry))
    with pytest.raises(HFConfigError, match="model.attention_sinks .*cannot be written as qwen3"):
        hf_config(model_config("tiny-qwen3", registry).model_copy(update={"attention_sinks": True}))
    hf = {"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64}
    with pytest.raises(HFConfigError, match="model_type 'gpt_oss' .*is not mapped yet"):
        model_fields_from_hf(hf)
