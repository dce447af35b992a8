"""Primus model configs map onto torchtitan's models exactly: same parameter count as core's formula."""

from __future__ import annotations

import pytest
import torch

from primus.core.config.presets import model_config
from primus.core.config.schema import ModelConfig
from primus.core.contracts.plugins import get_registry
from primus.core.planner.modelmath import count_params
from primus.torchtitan.models import base_train_spec, llama3_ffn_args, model_args


def preset(name: str) -> ModelConfig:
    return model_config(name, get_registry())


@pytest.mark.parametrize(
    "name",
    [
        "tiny-llama",
        "tiny-llama-4l",
        "tiny-mistral",
        "tiny-qwen3",
        "llama3.1-8b",
        "llama3.1-70b",
        "mistral-7b-v0.3",
        "qwen3-8b",
        "qwen3-32b",
        "tiny-qwen2",
        "qwen2.5-7b",
        "qwen2.5-0.5b",
        "llama3.2-1b",
        "qwen3-0.6b",
    ],
)
def test_torchtitan_model_has_the_preset_shape(name):
    m = preset(name)
    with torch.device("meta"):
        model = base_train_spec(m).model_cls(model_args(m, 64))
    assert sum(p.numel() for p in model.parameters()) == count_params(m).total
    ffn = model.layers["0"].feed_forward.w1
    assert ffn.out_features == m.ffn_hidden_size


@pytest.mark.parametrize(("hidden", "ffn"), [(128, 352), (4096, 14336), (8192, 28672), (2048, 8192), (512, 64)])
def test_llama3_ffn_args_give_exact_width(hidden, ffn):
    from torchtitan.models.llama3.model.model import FeedForward

    multiple_of, mult = llama3_ffn_args(hidden, ffn)
    with torch.device("meta"):
        assert FeedForward(hidden, 4 * hidden, multiple_of, mult).w1.out_features == ffn


def test_no_rope_scaling_leaves_frequencies_unchanged():
    from torchtitan.models.llama3.model.model import precompute_freqs_cis

    m = preset("tiny-llama")
    args = model_args(m, 64)
    plain = torch.polar(
        torch.ones(64, 16),
        torch.outer(torch.arange(64).float(), 1.0 / (m.rope_theta ** (torch.arange(0, 32, 2).float() / 32))),
    )
    assert torch.allclose(precompute_freqs_cis(32, 64, m.rope_theta, args.rope_scaling_args), plain)


def test_dense_model_ties_and_biases():
    from primus.torchtitan.dense import DenseTransformer

    m = preset("tiny-qwen2")
    with torch.device("meta"):
        model = DenseTransformer(model_args(m, 64))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight
    attn = model.layers["0"].attention
    assert all(getattr(attn, n).bias is not None and not getattr(attn, n).bias.any() for n in ("wq", "wk", "wv"))
    assert attn.wo.bias is None
    tokens = torch.randint(0, m.vocab_size, (2, 16))
    assert model(tokens).shape == (2, 16, m.vocab_size)
