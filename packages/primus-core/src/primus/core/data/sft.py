"""Fine-tuning samples (``train.objective: sft``): chat, instruction or prompt / completion records, loss on the
answers only.

Records are read from .jsonl (one a line), .json (a JSON array), Parquet and Arrow files (a row a record; a folder
``datasets`` wrote with ``save_to_disk`` is its Arrow files), by :func:`~primus.core.data.documents.iter_records`.
Each record is of a kind (:data:`KINDS`), told by its own keys (a file may mix them, as chats and prompt /
completion records always could) or named for every record by ``data.record_format``:

- ``messages`` (OpenAI's chat format): ``{"messages": [{"role": ..., "content": ...}, ...]}``;
- ``sharegpt``: ``{"conversations": [{"from": ..., "value": ...}, ...]}``, ``from`` human / user, gpt / assistant or
  system (:data:`SHAREGPT_ROLES`), taken as the ``messages`` record of those roles;
- ``alpaca``: ``{"instruction": ..., "input": ..., "output": ...}``, taken as a user message (the instruction, then
  the input after a blank line where there is one, as the Alpaca template puts them) and an assistant message (the
  output);
- ``prompt_completion``: ``{"prompt": ..., "completion": ...}``.

A chat record is rendered with the tokenizer's chat template (the ``data.tokenizer`` folder's
``chat_template.jinja``, as ``transformers`` 5 saves it, or the ``chat_template`` of its ``tokenizer_config.json``,
as 4.x did: :mod:`.chat_template`), as ``transformers`` renders it; each assistant message is trained on,
everything before it (system, user turns, the template's assistant header) is context. A prompt / completion record
trains on the completion and its end-of-sequence token.

Records are packed one after another into one stream of tokens with a parallel trainable mask, and cut into
windows of ``train.seq_len + 1`` like pretraining text (:class:`~primus.core.data.packed.PackedDataset`); the label
of a position whose next token is context is :data:`IGNORE_INDEX`, so it adds nothing to the loss or the gradient
(both engines average over the trainable tokens only). Tokens of one window may come from several records and
attend to each other (no document masking). That is ``data.sft_packing: stream``; ``padded`` and ``packed`` keep
each record whole in one sample (:mod:`.sft_packing`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from primus.core.data.chat_template import chat_template, special_tokens
from primus.core.data.documents import Input, iter_records
from primus.core.data.errors import DataError
from primus.core.data.labels import IGNORE_INDEX as IGNORE_INDEX  # re-exported: the engines import it from here


class ChatRenderer:
    """A chat template rendered as ``transformers``' ``apply_chat_template`` does (jinja2, sandboxed)."""

    def __init__(self, template: str, special: dict[str, str]) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise DataError(f"the chat template refused a record: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.template, self.special = env.from_string(template), special

    def __call__(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)


#: Roles a chat record's messages may have: an assistant message is trained on, the others are context (a
#: misspelt role would silently be context, so any other is refused).
ROLES = ("system", "user", "assistant", "tool")


def check_record(record: Any, where: str) -> None:
    """Refuse (:class:`DataError` naming ``where``, the file and line) a record that is not a fine-tuning record:
    ``messages`` (a non-empty list of {role, content} objects with roles of :data:`ROLES`, string content, at
    least one assistant message and none empty) or string ``prompt`` and non-empty ``completion``. Cheap: no
    template is rendered, nothing tokenized."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise DataError(f"{where}: 'messages' is a list of {{role, content}} objects")
        for i, message in enumerate(messages):
            role, content = message["role"], message.get("content")
            if role not in ROLES:
                raise DataError(f"{where}: message {i} has role {role!r}; allowed roles: {', '.join(ROLES)}")
            if not isinstance(content, str):
                raise DataError(f"{where}: message {i} ({role}): 'content' is a string, got {type(content).__name__}")
            if role == "assistant" and not content.strip():
                raise DataError(f"{where}: message {i} is an empty assistant message: nothing to train on")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant message to train on")
        return
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DataError(f"{where}: a record has 'messages', or string 'prompt' and 'completion' fields")
    if not completion.strip():
        raise DataError(f"{where}: an empty 'completion': nothing to train on")


def segments(record: Any, render: ChatRenderer | None, where: str) -> list[tuple[str, bool]]:
    """``record`` (a ``messages`` or ``prompt`` / ``completion`` record: :func:`as_chat`; checked by
    :func:`check_record`) as (text, trainable) pieces in order."""
    check_record(record, where)
    if "messages" in record:
        messages = record["messages"]
        if render is None:
            raise DataError(
                f"{where}: 'messages' records need a chat template: data.tokenizer names a folder with "
                "chat_template.jinja, or a tokenizer_config.json with a chat_template (a Hugging Face model folder)"
            )
        out: list[tuple[str, bool]] = []
        done = ""
        for i, message in enumerate(messages):
            if message["role"] == "assistant":  # the template's header for the answer is context, the answer not
                head = render(messages[:i], add_generation_prompt=True)
                out.append((head[len(done) :], False))
                done = head
            text = render(messages[: i + 1])
            if not text.startswith(done):
                raise DataError(f"{where}: the chat template does not render messages incrementally")
            out.append((text[len(done) :], message["role"] == "assistant"))
            done = text
        return [(t, trainable) for t, trainable in out if t]
    return [(record["prompt"], False), (record["completion"], True)]


#: The kinds of fine-tuning record, each by the keys that make one (the first kind whose keys a record has is its
#: kind; ``data.record_format`` names one for every record).
KINDS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
}
#: The keys of each kind, as a refusal names them.
EXPECTED = (
    "messages {messages}, sharegpt {conversations}, alpaca {instruction, output; input optional}, "
    "prompt_completion {prompt, completion}"
)
#: A ShareGPT turn's ``from`` -> the role of its message.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
#: The containers records are read from (:func:`~primus.core.data.documents.iter_records`).
CONTAINERS = ("jsonl", "json", "parquet", "arrow")


def record_kind(record: dict[str, Any]) -> str | None:
    """The kind (of :data:`KINDS`) whose keys ``record`` has, the first in that order; None for none."""
    return next((kind for kind, keys in KINDS.items() if all(k in record for k in keys)), None)


def as_chat(record: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    """A record of ``kind`` as the ``messages`` (or ``prompt`` / ``completion``) record it stands for, the fields
    its kind reads checked (a :class:`DataError` naming ``where``); other keys are left out."""
    if kind == "alpaca":
        instruction, extra, output = record["instruction"], record.get("input"), record["output"]
        if not isinstance(instruction, str) or not isinstance(output, str) or not isinstance(extra, str | None):
            raise DataError(f"{where}: an alpaca record has string 'instruction' and 'output' (and 'input', if any)")
        user = f"{instruction}\n\n{extra}" if extra else instruction  # the Alpaca template's blank line
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": output}]}
    if kind == "sharegpt":
        turns = record["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, dict) and "from" in t for t in turns):
            raise DataError(f"{where}: 'conversations' is a list of {{from, value}} objects")
        messages = []
        for i, turn in enumerate(turns):
            role = SHAREGPT_ROLES.get(turn["from"])
            if role is None:
                raise DataError(
                    f"{where}: conversations[{i}] is from {turn['from']!r}; allowed: {', '.join(SHAREGPT_ROLES)}"
                )
            if not isinstance(value := turn.get("value"), str):
                raise DataError(
                    f"{where}: conversations[{i}] ({turn['from']}): 'value' is a string, got {type(value).__name__}"
                )
            messages.append({"role": role, "content": value})
        return {"messages": messages}
    if kind == "messages":
        return {"messages": record["messages"]}
    return {"prompt": record["prompt"], "completion": record["completion"]}


def records(item: Input, kind: str = "auto") -> Iterator[tuple[dict[str, Any], str]]:
    """The records of ``item``, each checked (:func:`check_record`) and as :func:`as_chat` gives it, with where it is
    (``path:line``, ``path: record i``, ``path: row i``). Every record is of ``kind`` (``data.record_format``), or
    with ``auto`` of the kind its keys make; one that is not (another kind, or none) is refused, naming its keys and
    the kinds' (:data:`EXPECTED`)."""
    if item.format not in CONTAINERS:
        raise DataError(
            f"{item.path}: fine-tuning records are read from .jsonl, .json, .parquet and .arrow files (a save_to_disk "
            f"folder); got {item.format}"
        )
    for record, where in iter_records(item):
        if not isinstance(record, dict):
            raise DataError(f"{where}: a record is a JSON object (or a table row), got {type(record).__name__}")
        keys = list(record)
        found = record_kind(record) if kind == "auto" else kind
        if kind != "auto" and not all(k in record for k in KINDS[kind]):
            raise DataError(
                f"{where}: a record with keys {keys} is not of kind {kind} (data.record_format {kind}: keys "
                f"{list(KINDS[kind])}); the kinds: {EXPECTED}"
            )
        if found is None:
            raise DataError(f"{where}: a record with keys {keys} is none of the fine-tuning kinds; expected {EXPECTED}")
        chat = as_chat(record, found, where)
        check_record(chat, where)
        yield chat, where


def encode(
    inputs: list[Input], tokenizer: Any, eos: int, render: ChatRenderer | None, kind: str = "auto"
) -> tuple[np.ndarray, np.ndarray]:
    """Every record of ``inputs`` (of ``kind``: :func:`records`) as one token stream and its trainable mask (a
    prompt / completion record ends with ``eos``, trainable; a chat record ends as its template renders it)."""
    return encode_records(inputs, tokenizer, eos, render, kind)[:2]


def encode_records(
    inputs: list[Input], tokenizer: Any, eos: int, render: ChatRenderer | None, kind: str = "auto"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`encode`'s stream and mask, and each record's token count (in order: the stream's record bounds)."""
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lengths: list[int] = []
    for item in inputs:
        for record, where in records(item, kind):
            pieces = segments(record, render, where)
            n = len(ids)
            for text, trainable in pieces:
                tokens = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
                ids.append(tokens)
                masks.append(np.full(len(tokens), trainable))
            if "messages" not in record:
                ids.append(np.asarray([eos], dtype=np.int64))
                masks.append(np.ones(1, dtype=bool))
            lengths.append(sum(len(x) for x in ids[n:]))
    if not ids:
        raise DataError(f"{inputs[0].path if inputs else 'data.source'}: no fine-tuning records")
    return np.concatenate(ids), np.concatenate(masks), np.asarray(lengths, dtype=np.int64)


class SFTDataset:
    """Windows of ``seq_len + 1`` tokens of the packed stream: (inputs, labels), labels :data:`IGNORE_INDEX` where
    the next token is context."""

    def __init__(self, tokens: np.ndarray, trainable: np.ndarray, seq_len: int) -> None:
        self.tokens, self.trainable, self.seq_len = tokens, trainable, seq_len

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        start = index * self.seq_len
        inputs = self.tokens[start : start + self.seq_len]
        labels = self.tokens[start + 1 : start + self.seq_len + 1].copy()
        labels[~self.trainable[start + 1 : start + self.seq_len + 1]] = IGNORE_INDEX
        return inputs, labels


def renderer_for(tokenizer_spec: str, tokenizer: Any) -> ChatRenderer | None:
    template = chat_template(tokenizer_spec)
    return None if template is None else ChatRenderer(template, special_tokens(tokenizer_spec))


def sft_dataset(data: Any, tokenizer: Any, seq_len: int) -> Any:
    """The fine-tuning samples of ``data`` (a DataConfig) with ``tokenizer`` (loaded from ``data.tokenizer``): the
    stream's windows (:class:`SFTDataset`), or whole chats by ``data.sft_packing``
    (:class:`~primus.core.data.sft_packing.ChatSamples`)."""
    from primus.core.data.sources import source_inputs
    from primus.core.data.tokenizer import eos_id

    inputs = source_inputs(data)
    if not inputs:
        raise DataError("data.source: fine-tuning reads records from files (not the bundled corpus or mock)")
    render = renderer_for(data.tokenizer, tokenizer)
    eos = eos_id(tokenizer)
    tokens, trainable, lengths = encode_records(inputs, tokenizer, eos, render, data.record_format)
    if data.sft_packing == "stream":
        return SFTDataset(tokens, trainable, seq_len)
    from primus.core.data.sft_packing import ChatSamples

    # the attention masks by chat (packed, or data.document_mask): each sample carries its tokens' chat ids
    documents = data.sft_packing == "packed" or data.document_mask
    return ChatSamples(tokens, trainable, lengths, seq_len, data.sft_packing, pad=eos, documents=documents)
