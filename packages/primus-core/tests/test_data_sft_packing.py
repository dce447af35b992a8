"""Whole-chat fine-tuning samples (``data.sft_packing``: padded, packed): first-fit packing in data order, each
position's chat id, the labels of a chat alone (answers only, nothing across a chat's end), padding, truncation of a
chat longer than the sample, and the config rules. The engines' loss over these samples is tests/test_sft_packing.py.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from primus.core.data.sft import IGNORE_INDEX
from primus.core.data.sft_packing import ChatSamples, first_fit

# a chat template whose turns end with the tokenizer's EOS (as Qwen's end with <|im_end|> where that is the EOS):
# documents recomputed from EOS would split each chat at every turn
EOS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_first_fit_fills_the_first_sample_with_room_in_data_order():
    assert first_fit(np.array([5, 3, 4, 2, 1, 6]), 6) == [[0, 4], [1, 3], [2], [5]]
    assert first_fit(np.array([2, 2, 2]), 6) == [[0, 1, 2]]
    assert first_fit(np.array([7]), 7) == [[0]]
    sizes = np.random.default_rng(0).integers(1, 50, 500)
    bins = first_fit(sizes, 50)
    assert sorted(i for b in bins for i in b) == list(range(500))  # every chat once
    assert all(b == sorted(b) for b in bins) and all(sizes[b].sum() <= 50 for b in bins)
    # first fit: no chat would have fitted an earlier sample as it stood when the chat was placed
    room = []
    where = {i: k for k, b in enumerate(bins) for i in b}
    for i, size in enumerate(sizes):
        k = where[i]
        assert all(r < size for r in room[:k]), i
        if k == len(room):
            room.append(50)
        room[k] -= size


def _chats(lengths, seed=0):
    """Records' stream, trainable mask and lengths: chat c's tokens are 100·c + 0, 1, ...; its second half trained."""
    tokens = np.concatenate([100 * c + np.arange(n) for c, n in enumerate(lengths)])
    trainable = np.concatenate([np.arange(n) >= n // 2 for n in lengths])
    return tokens, trainable, np.asarray(lengths)


def _chat_rows(inputs, labels, documents, chats):
    """Each of a sample's ``chats`` chats: (its inputs, its labels), by document id."""
    return [(inputs[documents == d].tolist(), labels[documents == d].tolist()) for d in range(chats)]


def _alone(tokens, trainable, start, n):
    """A chat of n tokens at ``start`` as transformers' shifted loss sees it alone: inputs, labels."""
    chat, mask = tokens[start : start + n], trainable[start : start + n]
    return chat[:-1].tolist(), np.where(mask[1:], chat[1:], IGNORE_INDEX).tolist()


def test_packed_samples_hold_whole_chats_with_their_documents_and_labels():
    lengths = [9, 6, 12, 4, 3, 8]
    tokens, trainable, lens = _chats(lengths)
    packed = ChatSamples(tokens, trainable, lens, 12, "packed", pad=7, documents=True)
    sizes = [n - 1 for n in lengths]  # 8, 5, 11, 3, 2, 7 positions: chats 3 and 4 fill earlier samples' room
    assert packed.bins == first_fit(np.asarray(sizes), 12) == [[0, 3], [1, 4], [2], [5]]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for index, chats in enumerate(packed.bins):
        inputs, labels, documents = packed[index]
        assert inputs.dtype == labels.dtype == np.int64 and documents.dtype == np.int32
        assert len(inputs) == len(labels) == len(documents) == 12
        assert np.all(np.diff(documents) >= 0)  # documents in order, the padding last
        assert _chat_rows(inputs, labels, documents, len(chats)) == [
            _alone(tokens, trainable, starts[c], lengths[c]) for c in chats
        ]
        pad = documents == len(chats)
        assert pad.sum() == 12 - sum(sizes[c] for c in chats)
        assert np.all(inputs[pad] == 7) and np.all(labels[pad] == IGNORE_INDEX)
    # the labels are the answers only, each chat's last token a label and never an input of another chat
    _, labels, documents = packed[0]
    assert labels[documents == 0].tolist() == [IGNORE_INDEX] * 3 + list(range(4, 9))


def test_padded_samples_are_one_chat_each_in_data_order():
    lengths = [9, 5, 12]
    tokens, trainable, lens = _chats(lengths)
    padded = ChatSamples(tokens, trainable, lens, 12, "padded", pad=7)
    assert len(padded) == 3 and padded.bins == [[0], [1], [2]]
    inputs, labels = padded[1]  # no documents: causal attention never reads the padding after the chat
    assert inputs.tolist() == [100, 101, 102, 103] + [7] * 8
    assert labels.tolist() == [IGNORE_INDEX, 102, 103, 104] + [IGNORE_INDEX] * 8
    with pytest.raises(IndexError):
        padded[3]


def test_a_chat_longer_than_the_sample_is_truncated_and_counted(caplog):
    lengths = [30, 5, 14, 13]  # 30 and 14 tokens: more than seq_len + 1 = 13
    tokens, trainable, lens = _chats(lengths)
    with caplog.at_level(logging.INFO, logger="primus.data"):
        packed = ChatSamples(tokens, trainable, lens, 12, "packed", pad=7, documents=True)
    assert packed.truncated == 2
    assert (
        "data.sft_packing packed: 2 of 4 chats are longer than train.seq_len + 1 (13) tokens: truncated" in caplog.text
    )
    assert "data.sft_packing packed: 4 chats in 4 samples of 12 positions" in caplog.text
    inputs, labels, documents = packed[0]
    assert np.all(documents == 0)  # the first 13 tokens of chat 0 fill the sample
    assert inputs.tolist() == list(range(12))
    assert labels.tolist() == [IGNORE_INDEX] * 12  # its answer (from token 15) was cut off
    assert packed[3][0].tolist() == list(range(300, 312))  # 13 tokens: exactly one sample, not truncated


@pytest.fixture(scope="module")
def eos_folder(tmp_path_factory):
    """A tokenizer folder (the bundled tokenizer) whose chat template ends every turn with the EOS token."""
    from primus.core.data.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer("bundled").save(str(folder / "tokenizer.json"))
    config = {"chat_template": EOS_TEMPLATE, "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _samples(folder, tmp_path, mode, seq_len=96, **data):
    from primus.core.config.schema import DataConfig
    from primus.core.data.sft import sft_dataset
    from primus.core.data.tokenizer import load_tokenizer

    chats = [
        {
            "messages": [
                {"role": "user", "content": f"Count to {i}."},
                {"role": "assistant", "content": " ".join(str(k) for k in range(i))},
                *([{"role": "user", "content": "Again?"}, {"role": "assistant", "content": "No."}] if i % 2 else []),
            ]
        }
        for i in range(1, 9)
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    config = DataConfig(source=str(path), tokenizer=str(folder), sft_packing=mode, **data)
    return sft_dataset(config, load_tokenizer(str(folder)), seq_len)


def test_documents_come_from_the_records_not_from_eos(eos_folder, tmp_path):
    """Packed records of a template that ends turns with EOS: one document per chat (EOS would give one per turn),
    and each chat's (inputs, labels) are those of the padded sample of that chat alone."""
    import torch

    from primus.core.data.tokenizer import eos_id, load_tokenizer
    from primus.core.kernels.documents import document_ids

    packed, padded = _samples(eos_folder, tmp_path, "packed"), _samples(eos_folder, tmp_path, "padded")
    assert len(padded) == 8 and 1 < len(packed) < 8
    eos = eos_id(load_tokenizer(str(eos_folder)))
    alone = {}
    for i in range(len(padded)):
        inputs, labels = padded[i]
        n = int((labels != IGNORE_INDEX).nonzero()[0].max()) + 1  # the chat's positions (its last label)
        alone[i] = (inputs[:n].tolist(), labels[:n].tolist())
    for index, chats in enumerate(packed.bins):
        inputs, labels, documents = packed[index]
        assert _chat_rows(inputs, labels, documents, len(chats)) == [alone[c] for c in chats]
        from_eos = document_ids(torch.from_numpy(inputs)[None], eos)[0].numpy()
        assert from_eos.max() > documents.max()  # EOS inside the chats: every turn would be a document
    assert sorted(c for b in packed.bins for c in b) == list(range(8))
    # with data.document_mask the padded samples carry their documents too (the chat, then the padding)
    inputs, labels, documents = _samples(eos_folder, tmp_path, "padded", document_mask=True)[0]
    assert set(documents.tolist()) == {0, 1} and np.all(labels[documents == 1] == IGNORE_INDEX)


def test_sft_packing_is_validated(tmp_path):
    from primus.core.config.errors import ConfigError
    from primus.core.kernels.documents import masks_documents
    from primus.core.launch.resolve import resolve

    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"prompt": "Q", "completion": " A"}) + "\n")
    sft = ["train.objective=sft", f"data.source={path}"]

    def config(*overrides):
        return resolve("tiny-llama", [*sft, *overrides], world_size=1, check_plugins=False).config

    assert config().data.sft_packing == "stream" and not masks_documents(config())
    assert masks_documents(config("data.sft_packing=packed")) and not masks_documents(config("data.sft_packing=padded"))
    with pytest.raises(ConfigError) as info:
        config("data.sft_packing=bins")
    assert "data.sft_packing: Input should be 'stream', 'padded' or 'packed' (got 'bins')" in str(info.value)
    with pytest.raises(ConfigError, match=r"data.sft_packing: lays out fine-tuning chats .*train.objective sft"):
        resolve("tiny-llama", ["data.sft_packing=packed"], world_size=1, check_plugins=False)
    with pytest.raises(ConfigError, match=r"data.sft_packing: with parallel.cp=2: packed chats mask attention"):
        resolve("tiny-llama", [*sft, "data.sft_packing=packed", "parallel.cp=2"], world_size=2, check_plugins=False)


def test_a_resume_with_another_layout_is_a_data_change(tmp_path):
    """data.sft_packing moves the samples: a fine-tuning checkpoint records it (pretraining's fingerprint is as it
    was, so older checkpoints compare unchanged) and a resume with another layout names it."""
    from primus.core.data.fingerprint import changes, fingerprint
    from primus.core.launch.resolve import resolve

    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"prompt": "Q", "completion": " A"}) + "\n")

    def settings(*overrides):
        return fingerprint(resolve("tiny-llama", list(overrides), world_size=1, check_plugins=False).config)

    sft = ["train.objective=sft", f"data.source={path}"]
    padded, packed = settings(*sft, "data.sft_packing=padded"), settings(*sft, "data.sft_packing=packed")
    assert "data.sft_packing" not in settings(f"data.source={path}")["settings"]
    assert changes(padded, packed) == ["data.sft_packing padded in the checkpoint, packed now"]
    older = {**padded, "settings": {k: v for k, v in padded["settings"].items() if k != "data.sft_packing"}}
    assert changes(older, packed) == [] and changes(packed, packed) == []
