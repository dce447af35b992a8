"""Refuse a run's data before anything is written: :func:`check_data` raises, cheaply, the :class:`DataError` that
building the token stream (:func:`primus.core.data.sources.load_token_stream`) or an engine's dataset would raise
later, once the run folder exists.

It resolves the inputs (existence, extension, folders, globs, Megatron pairs), reads every line of each .jsonl
file (JSON, a string under ``data.text_key``; once per file version, remembered in the cache) and of each
fine-tuning file (every record checked, each of a kind), the first document of the other text files (UTF-8, ``data.text_key``),
the header of each Megatron index and the first tokens of its ``.bin``, and loads the tokenizer to compare its
size with ``model.vocab_size``. Nothing is tokenized. What only a full read of a .txt / .parquet / .arrow file can
find (bad UTF-8 deep in it) is still refused when the stream is built.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import TYPE_CHECKING, Any

from primus.core.data.cache import atomic_write, cache_root
from primus.core.data.documents import first_document, iter_documents
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
    ``eval.paths``: every input exists and has a known format; every line of each .jsonl file (valid JSON, a string
    under ``data.text_key``, or a fine-tuning record) and the first document of each other text file reads; the inputs hold at least one document; each Megatron pair has a sound index and its first
    tokens fit ``model.vocab_size``; the tokenizer loads, has an end-of-document token and fits
    ``model.vocab_size`` where the text is tokenized; a tokenizer named in ``data.tokenizer`` loads even where the
    source is already tokens (engines read its end-of-document id).
    """
    from primus.core.data.splits import blend_configs, eval_source

    sources = [b.path for b in cfg.data.blend] or [cfg.data.source]
    if cfg.train.objective == "sft" and {"bundled", "mock"} & set(sources):
        raise DataError(
            "train.objective sft trains on fine-tuning records (messages, ShareGPT, Alpaca or prompt / completion, in "
            ".jsonl, .json, Parquet or save_to_disk folders): set data.source (or data.blend) to them; the bundled "
            "corpus and mock tokens hold none"
        )
    for data, key, paths_key in blend_configs(cfg):
        _check_inputs(data, cfg.model.vocab_size, key, paths_key, cfg.train.objective)
    if (data := eval_source(cfg)) is not None:
        _check_inputs(data, cfg.model.vocab_size, "eval.source", "eval.paths", cfg.train.objective)


def check_records(item: Any, data: DataConfig) -> bool:
    """Every record of a fine-tuning input parses and is one, of the kind its keys (or data.record_format) say
    (:func:`~primus.core.data.sft.records`: a bad record deep in the file is refused now, not once the run folder
    exists); the first chat record also renders with the tokenizer's chat template. Whether the input holds any
    record."""
    from primus.core.data.sft import records, renderer_for, segments

    found = rendered = False
    for record, where in records(item, data.record_format):
        if not rendered and "messages" in record:
            segments(record, renderer_for(data.tokenizer, None), where)  # the template (and that there is one)
            rendered = True
        found = True
    return found


def check_jsonl(item: Any, text_key: str) -> bool:
    """Every line of a .jsonl input parses and has a string under ``text_key`` (else the :class:`DataError` naming
    file:line), read once per file version: a file that passed is remembered in the cache by path, size, mtime and
    ``text_key``, so the ranks and later runs do not read it again. Whether it holds a non-empty document."""
    stat = item.path.stat()
    key = json.dumps([str(item.path.resolve()), stat.st_size, stat.st_mtime_ns, text_key])
    mark = cache_root() / "checked" / hashlib.sha256(key.encode()).hexdigest()[:24]
    if mark.is_file():
        return mark.read_text() == "documents"
    found = False
    for doc in iter_documents(item, text_key):
        found = found or bool(doc)
    with contextlib.suppress(OSError):  # a read-only cache only costs a re-read
        atomic_write(mark, lambda tmp: tmp.write_text("documents" if found else "none"))
    return found


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
            found = check_records(item, data) or found
        elif item.format == "jsonl":
            found = check_jsonl(item, data.text_key) or found
        elif first_document(item, data.text_key) is not None:
            found = True
    if not found:
        raise DataError(f"{key} {data.source}: the inputs hold no documents")
