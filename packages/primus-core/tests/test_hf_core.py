"""The engine-neutral half of the Hugging Face interop: config.json <-> ModelConfig against ``transformers``'
own config classes, the sharded safetensors writer/reader, and the refusals (each names the key)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from primus.core.config.schema import RopeScaling
from primus.core.hf.config import HFConfigError, check_matches, hf_config, model_config_from_hf
from primus.core.hf.contract import hf_names
from primus.core.hf.safetensors_io import INDEX, HFReader, folder_problem, write_hf

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def test_llama31_config_with_rope_scaling_round_trips():
    rope = {**LLAMA3, "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    hf = transformers.LlamaConfig(**SMALL, vocab_size=256, max_position_embeddings=131072, rope_scaling=rope)
    m = model_config_from_hf(hf.to_dict())
    assert (m.family, m.num_kv_heads, m.ffn_hidden_size, m.rope_theta) == ("llama", 2, 96, 500000.0)
    assert m.rope_scaling == RopeScaling(type="llama3", factor=8.0, original_max_position_embeddings=8192)
    assert (m.qkv_bias, m.qk_norm, m.tie_word_embeddings, m.head_dim) == (False, False, False, None)
    back = transformers.AutoConfig.for_model(**hf_config(m))
    assert type(back) is transformers.LlamaConfig
    assert back.rope_parameters["rope_type"] == "llama3" and back.rope_parameters["rope_theta"] == 500000.0
    assert back.rope_parameters["original_max_position_embeddings"] == 8192
    assert model_config_from_hf(back.to_dict()) == m


def test_transformers_4_spelling_is_read_too():
    old = {"model_type": "llama", **SMALL, "vocab_size": 256, "rope_theta": 500000.0}
    old["rope_scaling"] = {**LLAMA3, "original_max_position_embeddings": 8192}
    new = transformers.LlamaConfig(**{k: v for k, v in old.items() if k != "model_type"}).to_dict()
    assert model_config_from_hf(old) == model_config_from_hf(new)


@pytest.mark.parametrize(
    ("cls", "family", "qkv_bias", "qk_norm"),
    [
        (transformers.Qwen2Config, "qwen2", True, False),
        (transformers.Qwen3Config, "qwen3", False, True),
        (transformers.MistralConfig, "mistral", False, False),
    ],
)
def test_families(cls, family, qkv_bias, qk_norm):
    extra = {"head_dim": 32} if family == "qwen3" else {}
    hf = cls(**SMALL, **extra, vocab_size=256, tie_word_embeddings=True, sliding_window=None)
    m = model_config_from_hf(hf.to_dict())
    assert (m.family, m.qkv_bias, m.qk_norm, m.tie_word_embeddings) == (family, qkv_bias, qk_norm, True)
    assert m.kv_channels == (32 if family == "qwen3" else 16)
    back = transformers.AutoConfig.for_model(**hf_config(m))
    assert type(back) is cls and back.tie_word_embeddings and back.head_dim == m.kv_channels
    assert model_config_from_hf(back.to_dict()) == m
    # the architecture's tensors: biases for Qwen2, q/k norms for Qwen3, no lm_head when tied
    model = transformers.AutoModelForCausalLM.from_config(back)
    assert sorted(hf_names(m)) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize(
    ("cls", "family", "fields"),
    [
        # a dense first layer (mlp_only_layers), then routed ones; top-k renormalised
        (
            transformers.Qwen3MoeConfig,
            "qwen3",
            dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
            | dict(mlp_only_layers=[0]),
        ),
        (transformers.MixtralConfig, "mistral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    ],
)
def test_moe_families(tmp_path, cls, family, fields):
    hf = cls(**SMALL, **fields, vocab_size=256)
    m = model_config_from_hf(hf.to_dict())
    e = m.moe
    assert (m.family, e.num_experts, e.experts_per_token, e.normalize_topk) == (family, 4, 2, True)
    assert e.expert_ffn_hidden_size == (48 if family == "qwen3" else 96)  # Mixtral's intermediate_size
    assert e.first_dense_layers == (1 if family == "qwen3" else 0)
    back = transformers.AutoConfig.for_model(**hf_config(m))
    assert type(back) is cls
    assert model_config_from_hf(back.to_dict()) == m
    check_matches(m, back.to_dict(), "here")
    # the tensors save_pretrained writes (one per expert, as the Hub checkpoints hold them) are hf_names
    transformers.AutoModelForCausalLM.from_config(back).save_pretrained(tmp_path)
    assert sorted(hf_names(m)) == sorted(HFReader(tmp_path).weight_map)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ],
)
def test_unsupported_moe_configs_name_the_key(change, key):
    hf = transformers.Qwen3MoeConfig(**SMALL, num_experts=4).to_dict() | change
    with pytest.raises(HFConfigError, match=key):
        model_config_from_hf(hf)


@pytest.mark.parametrize(
    ("change", "key"),
    [({"shared_experts": 1}, "model.moe.shared_experts"), ({"router": "sigmoid"}, "model.moe.router")],
)
def test_unwritable_moe_models_name_the_key(change, key):
    m = model_config_from_hf(transformers.Qwen3MoeConfig(**SMALL, num_experts=4, head_dim=16).to_dict())
    with pytest.raises(HFConfigError, match=key):
        hf_config(m.model_copy(update={"moe": m.moe.model_copy(update=change)}))


def test_a_moe_model_does_not_match_its_dense_twin():
    hf = transformers.Qwen3MoeConfig(**SMALL, num_experts=4, head_dim=16).to_dict()
    m = model_config_from_hf(hf).model_copy(update={"moe": None})
    with pytest.raises(HFConfigError, match="model.moe None vs"):
        check_matches(m, hf, "here")


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "mistral", "sliding_window": 1024, "max_position_embeddings": 4096}, "sliding_window"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ],
)
def test_unsupported_configs_name_the_key(change, key):
    hf = {**transformers.LlamaConfig(**SMALL).to_dict(), **change}
    with pytest.raises(HFConfigError, match=key):
        model_config_from_hf(hf)


def test_mismatched_model_names_every_key():
    hf = transformers.LlamaConfig(**SMALL, vocab_size=256).to_dict()
    m = model_config_from_hf(hf).model_copy(update={"vocab_size": 512, "num_kv_heads": 4})
    with pytest.raises(HFConfigError, match="model.num_kv_heads 4 vs 2.*model.vocab_size 512 vs 256"):
        check_matches(m, hf, "here")


def test_sharded_write_loads_in_transformers(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, vocab_size=256)).eval()
    m = model_config_from_hf(model.config.to_dict())
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    out = write_hf(tmp_path / "out", tensors, hf_config(m), max_shard_bytes=64 * 1024, tokenizer=tmp_path / "tok")
    index = json.loads((out / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    reader = HFReader(out)
    assert all(torch.equal(reader.get(n), t) for n, t in tensors.items())
    ids = torch.randint(0, 256, (1, 12))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_folder_problems(tmp_path):
    assert "no such folder" in folder_problem(tmp_path / "nope")
    assert "no config.json" in folder_problem(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert "no *.safetensors" in folder_problem(tmp_path)


def test_cli_refusals(tmp_path):
    def primus(*args):
        return subprocess.run([sys.executable, "-m", "primus.core.cli.app", *args], capture_output=True, text=True)

    proc = primus("checkpoint", "export", str(tmp_path / "nope"), "--to-hf", str(tmp_path / "x"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = primus("checkpoint", "import", "tiny-llama", "--from-hf", str(tmp_path), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "no config.json" in proc.stderr
    proc = primus("checkpoint", "export", str(tmp_path), "--to-hf", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--config" in proc.stderr
