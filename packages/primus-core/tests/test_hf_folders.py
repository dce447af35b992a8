"""What a Hugging Face folder holds besides its config, read and checked without an engine: the chat template as
``transformers`` 5 saves it (``chat_template.jinja``) or 4.x did (``tokenizer_config.json``), tokenizer files carried
into an export, every tensor mapped or the folder refused, and the one-process overrides that read a checkpoint of
any parallel layout."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import yaml

from primus.core.config.errors import ConfigError
from primus.core.config.schema import ParallelConfig
from primus.core.data.chat_template import chat_template, special_tokens
from primus.core.data.sft import renderer_for, segments
from primus.core.hf.config import HFConfigError, model_config_from_hf, model_fields_from_hf
from primus.core.hf.contract import OFFLINE_OVERRIDES, check_folder, hf_names, unmapped
from primus.core.hf.safetensors_io import HFCheckpointError, HFReader, copy_tokenizer, write_hf

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4"}]
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def saved_by_transformers(tmp_path_factory):
    """A tokenizer with a chat template, as today's ``transformers`` ``save_pretrained`` writes it."""
    from primus.core.data.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tok") / "t5"
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=load_tokenizer("bundled"), eos_token="<|endoftext|>", bos_token="<|pad|>"
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return folder, tok


def test_the_chat_template_of_transformers_5_is_read_and_renders_as_transformers(saved_by_transformers):
    folder, tok = saved_by_transformers
    assert (folder / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())  # 5.x: not in here
    assert chat_template(folder) == chat_template(folder / "tokenizer.json") == TEMPLATE
    assert special_tokens(folder) == {"eos_token": "<|endoftext|>", "bos_token": "<|pad|>"}
    render = renderer_for(str(folder), None)
    assert render is not None
    for prompt in (False, True):
        expected = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt)
        assert render(MESSAGES, add_generation_prompt=prompt) == expected
    pieces = segments({"messages": MESSAGES}, render, "x:1")
    assert [t for t, trainable in pieces if trainable] == ["4<|im_end|>\n"]


def test_the_chat_template_of_transformers_4_is_read_too(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "</s>"}))
    assert chat_template(tmp_path) == TEMPLATE
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert chat_template(tmp_path) == TEMPLATE
    assert chat_template("bundled") is None
    (tmp_path / "empty").mkdir()
    assert chat_template(tmp_path / "empty") is None


def test_an_export_carries_the_chat_template_as_transformers_5_writes_it(saved_by_transformers, tmp_path):
    folder, _ = saved_by_transformers
    copy_tokenizer(folder / "tokenizer.json", tmp_path / "from5")
    assert (tmp_path / "from5" / "chat_template.jinja").read_text() == TEMPLATE
    old = tmp_path / "old"  # 4.x: the template only inside tokenizer_config.json
    old.mkdir()
    (old / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (old / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    copy_tokenizer(old, tmp_path / "from4")
    assert (tmp_path / "from4" / "chat_template.jinja").read_text() == TEMPLATE
    for out in ("from5", "from4"):
        loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / out)
        assert loaded.chat_template == TEMPLATE, out


SHARED = [f"model.layers.{i}.mlp.shared_expert.{r}_proj.weight" for i in (0, 1) for r in ("gate", "up", "down")]
SHARED += ["model.layers.0.mlp.shared_expert_gate.weight", "model.layers.1.mlp.shared_expert_gate.weight"]


def _qwen3_moe():
    hf = transformers.Qwen3MoeConfig(
        **SMALL, vocab_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16
    )
    return model_config_from_hf(hf.to_dict())


def test_tensors_primus_does_not_map_are_named_and_rope_buffers_allowed():
    m = _qwen3_moe()
    rope = ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.1.self_attn.rotary_emb.inv_freq"]
    assert unmapped([*hf_names(m), *rope], m) == []
    assert unmapped([*hf_names(m), *rope, *SHARED], m) == sorted(SHARED)
    tied = model_config_from_hf(transformers.LlamaConfig(**SMALL, vocab_size=128, tie_word_embeddings=True).to_dict())
    assert unmapped([*hf_names(tied), "lm_head.weight"], tied) == []  # transformers ties it over the embedding
    assert unmapped([*hf_names(tied), "model.mtp.0.weight"], tied) == ["model.mtp.0.weight"]


@pytest.fixture(scope="module")
def shared_expert_folder(tmp_path_factory):
    """A Qwen3-MoE folder with shared-expert tensors besides the model's (Qwen2-MoE's names)."""
    from primus.core.hf.config import hf_config

    m = _qwen3_moe()
    tensors = {n: torch.zeros(2, 2) for n in [*hf_names(m), *SHARED]}
    folder = tmp_path_factory.mktemp("hf") / "shared"
    write_hf(folder, tensors, hf_config(m))
    return folder, m


def test_a_folder_with_unmapped_tensors_is_refused_naming_them(shared_expert_folder):
    folder, m = shared_expert_folder
    with pytest.raises(HFCheckpointError) as err:
        check_folder(m, HFReader(folder), f"HF folder {folder}")
    message = str(err.value)
    assert "8 tensor(s) of the folder are not part of the model" in message and "\n" not in message
    assert sorted(SHARED)[0] in message and sorted(SHARED)[4] not in message  # the first few, and the count


def test_init_from_a_folder_with_unmapped_tensors_is_refused_before_the_run(shared_expert_folder):
    from primus.core.launch.resolve import resolve

    folder, _ = shared_expert_folder
    with pytest.raises(ConfigError) as err:
        resolve("tiny-qwen3-moe", [f"train.init_from={folder}"], world_size=1, check_plugins=False)
    assert "train.init_from" in str(err.value) and "8 tensor(s)" in str(err.value)


def test_shared_expert_config_keys_are_refused():
    hf = {**transformers.Qwen3MoeConfig(**SMALL, vocab_size=128, num_experts=4).to_dict()}
    hf["shared_expert_intermediate_size"] = 64
    with pytest.raises(HFConfigError, match="shared_expert_intermediate_size 64"):
        model_fields_from_hf(hf)


def test_offline_overrides_read_a_checkpoint_of_any_parallel_layout(tmp_path):
    """The run's every parallel key (ep and dp_shard among them) gives way: one process loads the checkpoint."""
    from primus.core.launch.resolve import resolve

    layout = dict(tp=2, pp=2, vpp=2, cp=2, ep=2, dp_shard=2, dp_replicate=2, sequence_parallel=True, fsdp=True)
    layout |= dict(pp_schedule="interleaved_1f1b", distributed_optimizer=True, recompute="full", recompute_layers=1)
    assert set(layout) | {"strategy", "overlap_grad_reduce", "overlap_param_gather", "reshard_after_forward"} | {
        "recompute_method"
    } == set(ParallelConfig.model_fields)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"extends": ["tiny-qwen3-moe"], "parallel": layout}))
    cfg = resolve(str(config), list(OFFLINE_OVERRIDES), world_size=1, check_plugins=False).config
    defaults = ParallelConfig().model_dump()
    assert cfg.parallel.model_dump() == {**defaults, "dp_shard": 1}
