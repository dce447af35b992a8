"""Fine-tuning records: which tokens are trained on (the answers), how records are packed, what is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from primus.core.data import DataError
from primus.core.data.sft import IGNORE_INDEX, ChatRenderer, SFTDataset, segments

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_each_assistant_turn_is_trained_on_and_its_header_is_context():
    render = ChatRenderer(TEMPLATE, {})
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    pieces = segments({"messages": messages}, render, "x:1")
    assert "".join(t for t, _ in pieces) == render(messages)  # nothing lost or repeated
    assert [t for t, trainable in pieces if trainable] == ["hello</s>", "ciao</s>"]
    assert ("<assistant>", False) in pieces


def test_prompt_completion_and_refusals():
    assert segments({"prompt": "Q:", "completion": " A"}, None, "x:1") == [("Q:", False), (" A", True)]
    with pytest.raises(DataError, match="x:2: no assistant message"):
        segments({"messages": [{"role": "user", "content": "hi"}]}, ChatRenderer(TEMPLATE, {}), "x:2")
    with pytest.raises(DataError, match="need a chat template"):
        segments({"messages": [{"role": "assistant", "content": "hi"}]}, None, "x:3")
    with pytest.raises(DataError, match="string 'prompt' and 'completion'"):
        segments({"prompt": "Q"}, None, "x:4")


def test_labels_of_context_positions_are_ignored():
    tokens = np.arange(10)
    trainable = np.array([0, 0, 0, 1, 1, 0, 0, 1, 1, 1], dtype=bool)
    ds = SFTDataset(tokens, trainable, seq_len=4)
    assert len(ds) == 2
    inputs, labels = ds[0]
    assert inputs.tolist() == [0, 1, 2, 3] and labels.tolist() == [IGNORE_INDEX, IGNORE_INDEX, 3, 4]
    assert ds[1][1].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 7, 8]


def test_sft_needs_jsonl_records():
    from primus.core.data.checks import check_data
    from primus.core.launch.train import resolve

    cfg = resolve("tiny-llama", ["train.objective=sft"], world_size=1, check_plugins=False).config
    with pytest.raises(DataError, match="train.objective sft trains on .jsonl records"):
        check_data(cfg)


def test_fine_tuning_evaluation_data_is_checked_as_records(tmp_path):
    """eval.source of a fine-tuning run holds records like data.source (not documents under data.text_key)."""
    from primus.core.data.checks import check_data
    from primus.core.launch.train import resolve

    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text(json.dumps({"prompt": "Q:", "completion": " A"}) + "\n")
    overrides = [
        "train.objective=sft",
        f"data.source={tmp_path / 'train.jsonl'}",
        f"eval.source={tmp_path / 'eval.jsonl'}",
    ]
    check_data(resolve("tiny-llama", overrides, world_size=1, check_plugins=False).config)
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "Q:"}) + "\n")
    with pytest.raises(DataError, match="string 'prompt' and 'completion'"):
        check_data(resolve("tiny-llama", overrides, world_size=1, check_plugins=False).config)
