"""``train.init_from`` on the config side (no engine): a Hugging Face folder's config.json is the model's layer,
named as such; what the user set themselves and disagrees is refused with both values; a Primus checkpoint is
found (a folder of them: the newest complete one) with the engine that wrote it; anything else names the key;
And core's canonical initial weights: deterministic per name,
drawable by rows."""

from __future__ import annotations

import json

import pytest
import yaml

from primus.core.config.errors import ConfigError
from primus.core.config.schema import ModelConfig
from primus.core.hf.contract import hf_names
from primus.core.launch.resolve import resolve
from primus.core.run import checkpoints
from primus.core.run import initial_weights as init
from primus.core.run.init_from import source

HF = {
    "model_type": "qwen3",
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 2048,
    "max_position_embeddings": 512,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


@pytest.fixture
def hf_dir(tmp_path):
    folder = tmp_path / "my-qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF))
    (folder / "model.safetensors").write_bytes(b"")  # the config side never reads weights
    return folder


def test_config_json_is_the_models_layer(hf_dir, registry):
    res = resolve("tiny-llama", ["backend.name=fake", f"train.init_from={hf_dir}"], world_size=1, registry=registry)
    m = res.config.model
    assert (m.family, m.hidden_size, m.num_layers, m.kv_channels, m.ffn_hidden_size) == ("qwen3", 96, 3, 32, 160)
    assert m.qk_norm and m.tie_word_embeddings and m.rope_theta == 1e6 and m.name == "my-qwen"
    assert res.layers.sources["model.hidden_size"] == f"config.json {hf_dir}"
    assert res.layers.sources["train.init_from"] == "command line"


def test_a_model_field_the_user_set_must_agree(hf_dir, registry, tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text(yaml.safe_dump({"extends": ["tiny-llama"], "model": {"hidden_size": 128, "num_layers": 3}}))
    with pytest.raises(ConfigError) as err:
        resolve(str(mine), ["backend.name=fake", f"train.init_from={hf_dir}"], world_size=1, registry=registry)
    text = str(err.value)
    assert "train.init_from" in text and "model.hidden_size 128 vs 96" in text and "mine.yaml" in text
    assert "num_layers" not in text  # set by the user too, but equal
    with pytest.raises(ConfigError, match="model.vocab_size 4096 vs 2048"):
        resolve("tiny-llama", ["backend.name=fake", f"train.init_from={hf_dir}", "model.vocab_size=4096"], 1, registry)


def test_the_old_key_is_refused_naming_it(hf_dir, registry):
    """``train.init_from_hf`` (renamed ``train.init_from`` before 0.1.0) is an unknown key now, refused by name."""
    with pytest.raises(ConfigError, match=r"train\.init_from_hf"):
        resolve("tiny-llama", ["backend.name=fake", f"train.init_from_hf={hf_dir}"], world_size=1, registry=registry)


def test_checkpoints_and_refusals(tmp_path, registry):
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        folder = checkpoints.NAMING.folder(root, step)
        folder.mkdir(parents=True)
        (folder / checkpoints.MANIFEST).write_text(json.dumps({"step": step, "backend": "fake"}))
    (root / "step_00000006.tmp").mkdir()  # a save cut short is never taken
    assert source(root) == source(root / "step_00000004")
    assert (source(root).kind, source(root).path.name, source(root).backend) == ("checkpoint", "step_00000004", "fake")
    for bad, why in ((tmp_path / "nope", "no such file"), (tmp_path / "checkpoints" / "step_00000006.tmp", "neither")):
        with pytest.raises(ConfigError) as err:
            resolve("tiny-llama", ["backend.name=fake", f"train.init_from={bad}"], world_size=1, registry=registry)
        assert "train.init_from" in str(err.value) and why in str(err.value)


def test_canonical_weights_are_a_function_of_seed_and_name():
    m = ModelConfig(num_layers=2)
    name = "model.layers.1.self_attn.q_proj.weight"
    a = init.tensor(name, m, seed=7)
    assert a.shape == (m.num_attention_heads * m.kv_channels, m.hidden_size)
    assert a.std().item() == pytest.approx(m.init_std, rel=0.1)
    assert (init.tensor(name, m, seed=7) == a).all() and not (init.tensor(name, m, seed=8) == a).all()
    assert not (init.tensor("model.layers.0.self_attn.q_proj.weight", m, seed=7) == a).all()
    # any rows on their own equal those rows of the whole tensor: a shard is drawn without the rest
    assert (init.tensor(name, m, seed=7, rows=slice(70, 100)) == a[70:100]).all()
    down = init.tensor("model.layers.0.mlp.down_proj.weight", m, seed=7)
    assert down.std().item() == pytest.approx(m.init_std / (2 * m.num_layers) ** 0.5, rel=0.1)
    assert (init.tensor("model.norm.weight", m, seed=7) == 1).all()
    assert set(init.shapes(m)) == set(hf_names(m))


@pytest.mark.parametrize(
    ("preset", "router", "expert"),
    [
        ("tiny-qwen3-moe", "mlp.gate.weight", "mlp.experts.{j}.{role}_proj.weight"),
        ("tiny-mixtral", "block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.{role}.weight"),
    ],
)
def test_canonical_init_names_every_routed_expert(preset, router, expert):
    """A MoE layer's tensors are its router and one gate / up / down per expert, by the Hub checkpoints' names
    (Qwen3-MoE's or Mixtral's); each expert is drawn on its own (experts differ), its down projection scaled."""
    import torch

    from primus.core.config.presets import model_config
    from primus.core.contracts.plugins import get_registry

    m = model_config(preset, get_registry())
    e, names = m.moe, hf_names(m)
    roles = (
        {"gate": "gate", "up": "up", "down": "down"} if "qwen" in preset else {"gate": "w1", "up": "w3", "down": "w2"}
    )
    p = "model.layers.1."
    assert p + router in names and init.shapes(m)[p + router][0] == (e.num_experts, m.hidden_size)
    for j in range(e.num_experts):
        for name in roles.values():
            assert p + expert.format(j=j, role=name) in names
    assert not any("mlp.gate_proj" in n or "mlp.down_proj" in n for n in names)  # no dense MLP is left
    assert set(init.shapes(m)) == set(names)
    down0 = init.tensor(p + expert.format(j=0, role=roles["down"]), m, seed=3)
    down1 = init.tensor(p + expert.format(j=1, role=roles["down"]), m, seed=3)
    assert down0.shape == (m.hidden_size, e.expert_ffn_hidden_size) and not torch.equal(down0, down1)
    assert down0.std().item() == pytest.approx(m.init_std / (2 * m.num_layers) ** 0.5, rel=0.1)


def test_canonical_init_names_the_shared_experts():
    """model.moe.shared_experts: one SwiGLU MLP of shared_experts x expert width per MoE layer, under DeepSeek's names
    (mlp.shared_experts.*_proj), its down projection scaled."""
    from primus.core.config.presets import model_config
    from primus.core.contracts.plugins import get_registry

    m = model_config("tiny-qwen3-moe", get_registry())
    m = m.model_copy(update={"moe": m.moe.model_copy(update={"shared_experts": 2})})
    shapes, width = init.shapes(m), 2 * m.moe.expert_ffn_hidden_size
    p = "model.layers.0.mlp.shared_experts."
    assert shapes[p + "gate_proj.weight"] == ((width, m.hidden_size), "normal")
    assert shapes[p + "up_proj.weight"] == ((width, m.hidden_size), "normal")
    assert shapes[p + "down_proj.weight"] == ((m.hidden_size, width), "scaled")
    assert set(shapes) == set(hf_names(m))
