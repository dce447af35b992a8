"""Refuse a run's data before anything is written: :func:`check_data` raises, cheaply, the :class:`DataError` that
building the token stream (:func:`primus.core.data.sources.load_token_stream`) or an engine's dataset would raise
later, once the run folder exists.

Cheap for a corpus of any size: it resolves the inputs (existence, extension, folders, globs, Megatron pairs),
reads the first document of each text file (UTF-8, JSON, ``data.text_key``), the header of each Megatron index
and the first tokens of its ``.bin``, and loads the tokenizer to compare its size with ``model.vocab_size``.
Nothing is tokenized. What only a full read can find (a bad line deep in a file) is still refused when the
stream is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from primus.core.data.documents import first_document
from primus.core.data.errors import DataError
from primus.core.data.indexed import IndexedReader
from primus.core.data.sources import check_token_ids, needs_tokenizer, source_inputs, text_tokenizer
from primus.core.data.tokenizer import BUNDLED, eos_id, load_tokenizer

if TYPE_CHECKING:
    from primus.core.config.schema import DataConfig, PrimusConfig

#: Tokens of each Megatron ``.bin`` whose ids are compared with ``model.vocab_size``.
SAMPLE_TOKENS = 1 << 20


def check_data(cfg: PrimusConfig) -> None:
    """Raise the :class:`DataError` (exit 2, naming the key or file) that ``cfg``'s data would give at run time.

    Checked, for ``data`` (each source of ``data.blend``) and for the evaluation inputs of ``eval.source`` /
    ``eval.paths``: every input exists and has a known format; each text file's first document reads (UTF-8, valid JSON, a string under
    ``data.text_key``); the inputs hold at least one document; each Megatron pair has a sound index and its first
    tokens fit ``model.vocab_size``; the tokenizer loads, has an end-of-document token and fits
    ``model.vocab_size`` where the text is tokenized; a tokenizer named in ``data.tokenizer`` loads even where the
    source is already tokens (engines read its end-of-document id).
    """
    from primus.core.data.splits import blend_configs, eval_source

    sources = [b.path for b in cfg.data.blend] or [cfg.data.source]
    if cfg.train.objective == "sft" and {"bundled", "mock"} & set(sources):
        raise DataError(
            "train.objective sft trains on .jsonl records (messages, or prompt / completion): set data.source "
            "(or data.blend) to them; the bundled corpus and mock tokens hold none"
        )
    for data, key, paths_key in blend_configs(cfg):
        _check_inputs(data, cfg.model.vocab_size, key, paths_key, cfg.train.objective)
    if (data := eval_source(cfg)) is not None:
        _check_inputs(data, cfg.model.vocab_size, "eval.source", "eval.paths", cfg.train.objective)


def check_first_record(item: Any, data: DataConfig) -> bool:
    """A fine-tuning input's first record is one (messages with a chat template, or prompt / completion)."""
    from primus.core.data.sft import records, renderer_for, segments

    for record, where in records(item):
        render = renderer_for(data.tokenizer, None) if isinstance(record, dict) and "messages" in record else None
        segments(record, render, where)
        return True
    return False


def _check_inputs(data: DataConfig, vocab: int, key: str, paths_key: str, objective: str = "pretrain") -> None:
    inputs = source_inputs(data, key, paths_key)
    if needs_tokenizer(data, inputs):
        eos_id(text_tokenizer(data, None, vocab))
    elif data.tokenizer != BUNDLED:
        load_tokenizer(data.tokenizer)
    found = data.source in ("bundled", "mock")
    for item in inputs:
        if item.format == "megatron":
            reader = IndexedReader(item.path)
            head = reader.tokens[:SAMPLE_TOKENS]
            if head.size:
                check_token_ids(data, int(head.max()), vocab)
            found = found or len(reader) > 0
        elif objective == "sft":
            found = check_first_record(item, data) or found
        elif first_document(item, data.text_key) is not None:
            found = True
    if not found:
        raise DataError(f"{key} {data.source}: the inputs hold no documents")
