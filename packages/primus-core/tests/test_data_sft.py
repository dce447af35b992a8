"""Fine-tuning records: which tokens are trained on (the answers), how records are packed, what is refused; the
record kinds (messages, ShareGPT, Alpaca, prompt / completion) in each container (.jsonl, .json, Parquet, a
``datasets`` save_to_disk folder) give the samples of the same conversations as ``messages`` records."""

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


def test_sft_needs_records():
    from primus.core.data.checks import check_data
    from primus.core.launch.resolve import resolve

    cfg = resolve("tiny-llama", ["train.objective=sft"], world_size=1, check_plugins=False).config
    with pytest.raises(DataError, match="train.objective sft trains on fine-tuning records"):
        check_data(cfg)


def test_fine_tuning_evaluation_data_is_checked_as_records(tmp_path):
    """eval.source of a fine-tuning run holds records like data.source (not documents under data.text_key)."""
    from primus.core.data.checks import check_data
    from primus.core.launch.resolve import resolve

    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text(json.dumps({"prompt": "Q:", "completion": " A"}) + "\n")
    overrides = [
        "train.objective=sft",
        f"data.source={tmp_path / 'train.jsonl'}",
        f"eval.source={tmp_path / 'eval.jsonl'}",
    ]
    check_data(resolve("tiny-llama", overrides, world_size=1, check_plugins=False).config)
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "Q:"}) + "\n")
    with pytest.raises(DataError, match=r"eval.jsonl:1: a record with keys \['prompt'\] is none of the fine-tuning"):
        check_data(resolve("tiny-llama", overrides, world_size=1, check_plugins=False).config)


# ------------------------------------------------------------------------------ record kinds × containers

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the same conversations in each kind, and as messages records
SHAREGPT = [
    {
        "id": "a",
        "conversations": [
            {"from": "system", "value": "You count."},
            {"from": "human", "value": "What comes after 1?"},
            {"from": "gpt", "value": "2."},
            {"from": "human", "value": "And after 2?"},
            {"from": "gpt", "value": "3, then 4."},
        ],
    },
    {"id": "b", "conversations": [{"from": "user", "value": "Hi"}, {"from": "assistant", "value": "Hello there."}]},
]
SHAREGPT_AS_MESSAGES = [
    {
        "messages": [
            {"role": "system", "content": "You count."},
            {"role": "user", "content": "What comes after 1?"},
            {"role": "assistant", "content": "2."},
            {"role": "user", "content": "And after 2?"},
            {"role": "assistant", "content": "3, then 4."},
        ]
    },
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]},
]
ALPACA = [
    {"instruction": "Add the numbers.", "input": "3 and 4", "output": "7"},
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"instruction": "Say hello.", "output": "Hello!"},  # no input at all
]
ALPACA_AS_MESSAGES = [  # the Alpaca template's layout: the input after a blank line, where there is one
    {"messages": [{"role": "user", "content": "Add the numbers.\n\n3 and 4"}, {"role": "assistant", "content": "7"}]},
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]},
    {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]},
]
PROMPTS = [{"prompt": "Q: 1 + 1?", "completion": " 2"}, {"prompt": "Q: 2 + 3?", "completion": " 5"}]
KIND_RECORDS = {
    "messages": (SHAREGPT_AS_MESSAGES + ALPACA_AS_MESSAGES, None),
    "sharegpt": (SHAREGPT, SHAREGPT_AS_MESSAGES),
    "alpaca": (ALPACA, ALPACA_AS_MESSAGES),
    "prompt_completion": (PROMPTS, None),
}
CONTAINERS = ("jsonl", "json", "parquet", "save_to_disk")


def write(records: list, folder, container: str):
    """``records`` in ``container``: a .jsonl / .json / .parquet file, or a folder ``datasets`` saved (two
    shards, each a file of its own)."""
    folder.mkdir(parents=True, exist_ok=True)
    if container == "jsonl":
        path = folder / "records.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif container == "json":
        path = folder / "records.json"
        path.write_text(json.dumps(records, indent=1))
    elif container == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "records.parquet"
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        import datasets

        path = folder / "saved"
        datasets.Dataset.from_list(records).save_to_disk(str(path), num_shards=min(2, len(records)))
    return path


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A tokenizer folder with a ChatML chat template (the bundled tokenizer), and the tokenizer."""
    from primus.core.data.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer("bundled").save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>"}))
    return folder, load_tokenizer(str(folder))


def samples(path, chat_tokenizer, **data):
    """The fine-tuning samples Primus builds of ``path``: its token stream and trainable mask."""
    from primus.core.config.schema import DataConfig
    from primus.core.data.sft import sft_dataset

    folder, tok = chat_tokenizer
    ds = sft_dataset(DataConfig(source=str(path), tokenizer=str(folder), **data), tok, seq_len=8)
    return ds.tokens, ds.trainable


@pytest.mark.parametrize(
    ("kind", "container"),
    # every pair but the references themselves (messages, prompt / completion .jsonl)
    [(k, c) for k, (_, as_messages) in KIND_RECORDS.items() for c in CONTAINERS if as_messages or c != "jsonl"],
)
def test_each_kind_in_each_container_gives_the_samples_of_its_messages(kind, container, chat_tokenizer, tmp_path):
    """A kind's records give the token ids and loss mask of the same conversations as messages records (.jsonl);
    messages and prompt / completion records in another container, those of their .jsonl."""
    records, as_messages = KIND_RECORDS[kind]
    reference = write(as_messages or records, tmp_path / "reference", "jsonl")
    tokens, trainable = samples(write(records, tmp_path / "data", container), chat_tokenizer)
    want_tokens, want_trainable = samples(reference, chat_tokenizer)
    assert 0 < want_trainable.mean() < 1  # context and answers
    assert tokens.tolist() == want_tokens.tolist() and trainable.tolist() == want_trainable.tolist()
    named = samples(write(records, tmp_path / "named", container), chat_tokenizer, record_format=kind)
    assert named[0].tolist() == want_tokens.tolist() and named[1].tolist() == want_trainable.tolist()


def test_the_answers_are_what_is_trained_on(chat_tokenizer, tmp_path):
    """Of Alpaca and ShareGPT records, exactly the outputs / gpt turns (with the template's end marker) are
    trained on."""
    _, tok = chat_tokenizer
    for records, answers in ((ALPACA, ["7", "Blue.", "Hello!"]), (SHAREGPT, ["2.", "3, then 4.", "Hello there."])):
        tokens, trainable = samples(write(records, tmp_path / str(len(answers)) / "x", "json"), chat_tokenizer)
        edges = np.flatnonzero(np.diff(np.r_[0, trainable.astype(int), 0]))
        spans = [tok.decode(tokens[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2], strict=True)]
        assert spans == [f"{a}<|im_end|>\n" for a in answers]


def _refused(path, fragment: str, chat_tokenizer, **data):
    """Building the samples and the run's data check both refuse ``path`` with ``fragment``."""
    from primus.core.config.schema import DataConfig
    from primus.core.data.checks import check_records
    from primus.core.data.sources import source_inputs

    with pytest.raises(DataError) as built:
        samples(path, chat_tokenizer, **data)
    assert fragment in str(built.value), str(built.value)
    cfg = DataConfig(source=str(path), tokenizer=str(chat_tokenizer[0]), **data)
    with pytest.raises(DataError) as checked:
        for item in source_inputs(cfg):
            check_records(item, cfg)
    assert str(checked.value) == str(built.value)
    return str(built.value)


def test_a_record_of_no_kind_is_refused_naming_file_index_and_keys(chat_tokenizer, tmp_path):
    from primus.core.data.sft import EXPECTED

    bad = {"question": "1 + 1?", "answer": "2"}
    path = write([ALPACA[0], ALPACA[1], bad], tmp_path / "a", "jsonl")
    text = _refused(path, f"{path}:3: a record with keys ['question', 'answer'] is none of", chat_tokenizer)
    assert EXPECTED in text
    assert "instruction, output" in EXPECTED and "conversations" in EXPECTED and "prompt, completion" in EXPECTED
    path = write([bad], tmp_path / "b", "parquet")
    _refused(path, f"{path}: row 0: a record with keys ['question', 'answer'] is none of", chat_tokenizer)
    path = write([PROMPTS[0], bad], tmp_path / "c", "json")
    _refused(path, f"{path}: record 1: a record with keys ['question', 'answer']", chat_tokenizer)


def test_a_file_mixing_kinds_reads_each_record_as_its_own(chat_tokenizer, tmp_path):
    """With data.record_format auto each record's keys tell its kind (chats and prompt / completion records always
    mixed): the samples of a mixed file are those of the same records each as messages (or prompt / completion)."""
    mixed = write(ALPACA + SHAREGPT + PROMPTS, tmp_path / "mixed", "jsonl")
    same = write(ALPACA_AS_MESSAGES + SHAREGPT_AS_MESSAGES + PROMPTS, tmp_path / "same", "jsonl")
    got, want = samples(mixed, chat_tokenizer), samples(same, chat_tokenizer)
    assert 0 < want[1].mean() < 1
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_a_named_kind_refuses_records_of_another(chat_tokenizer, tmp_path):
    path = write(ALPACA, tmp_path / "a", "parquet")
    _refused(
        path,
        f"{path}: row 0: a record with keys ['instruction', 'input', 'output'] is not of kind sharegpt "
        "(data.record_format sharegpt: keys ['conversations'])",
        chat_tokenizer,
        record_format="sharegpt",
    )


@pytest.mark.parametrize(
    ("record", "fragment"),
    [
        (
            {"conversations": [{"from": "bot", "value": "x"}]},
            "conversations[0] is from 'bot'; allowed: human, user, gpt",
        ),
        ({"conversations": [{"from": "human", "value": 3}]}, "conversations[0] (human): 'value' is a string, got int"),
        ({"conversations": [{"from": "human", "value": "hi"}]}, "no assistant message to train on"),
        ({"conversations": "hi"}, "'conversations' is a list of {from, value} objects"),
        ({"instruction": "x", "output": 7}, "an alpaca record has string 'instruction' and 'output'"),
        ({"instruction": "x", "output": " "}, "message 1 is an empty assistant message"),
    ],
)
def test_bad_sharegpt_and_alpaca_records_are_refused(record, fragment, chat_tokenizer, tmp_path):
    path = write([record], tmp_path, "jsonl")
    _refused(path, f"{path}:1: {fragment}", chat_tokenizer)


def test_containers_that_hold_no_records_are_refused(chat_tokenizer, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("plain text")
    _refused(path, f"{path}: fine-tuning records are read from .jsonl, .json, .parquet and .arrow", chat_tokenizer)
    path = tmp_path / "object.json"
    path.write_text(json.dumps({"instruction": "x", "output": "y"}))
    _refused(path, f"{path}: a .json file holds a JSON array of records, got a JSON dict", chat_tokenizer)
    path = tmp_path / "lines.json"
    path.write_text(json.dumps(ALPACA[0]) + "\n" + json.dumps(ALPACA[1]) + "\n")
    _refused(path, "one record a line is JSON Lines (rename it .jsonl, or set data.format=jsonl)", chat_tokenizer)


def test_record_format_is_validated_by_name_and_objective(tmp_path):
    from primus.core.config.errors import ConfigError
    from primus.core.launch.resolve import resolve

    path = write(ALPACA, tmp_path, "jsonl")
    sft = ["train.objective=sft", f"data.source={path}"]
    assert (
        resolve(
            "tiny-llama", [*sft, "data.record_format=alpaca"], world_size=1, check_plugins=False
        ).config.data.record_format
        == "alpaca"
    )
    with pytest.raises(ConfigError) as info:
        resolve("tiny-llama", [*sft, "data.record_format=chatml"], world_size=1, check_plugins=False)
    allowed = "'auto', 'messages', 'sharegpt', 'alpaca' or 'prompt_completion'"
    assert f"data.record_format: Input should be {allowed} (got 'chatml')" in str(info.value)
    with pytest.raises(ConfigError, match="data.record_format: names fine-tuning records .*train.objective sft"):
        resolve("tiny-llama", [f"data.source={path}", "data.record_format=alpaca"], world_size=1, check_plugins=False)


def test_a_save_to_disk_folder_of_text_still_reads_for_pretraining(tmp_path):
    """The metadata .json files of a datasets folder are not inputs (now that .json files are): pretraining reads
    the folder's documents, and a .json array of documents reads like its .jsonl."""
    import datasets

    from primus.core.config.schema import DataConfig
    from primus.core.data.documents import DATASETS_METADATA, iter_documents
    from primus.core.data.sources import source_inputs

    datasets.Dataset.from_list([{"text": "one"}, {"text": "two"}]).save_to_disk(str(tmp_path / "hf"))
    assert {p.name for p in (tmp_path / "hf").iterdir()} & set(DATASETS_METADATA)
    inputs = source_inputs(DataConfig(source=str(tmp_path / "hf")))
    assert [i.format for i in inputs] == ["arrow"]
    assert [d for i in inputs for d in iter_documents(i)] == ["one", "two"]
    (tmp_path / "docs.json").write_text(json.dumps([{"text": "one"}, {"text": "two"}]))
    assert list(iter_documents(source_inputs(DataConfig(source=str(tmp_path / "docs.json")))[0])) == ["one", "two"]
