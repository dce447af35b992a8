"""One token stream for training: every document of the configured source, tokenized, EOS after each.

``data.source`` is ``"bundled"`` (the stdlib docstring corpus), ``"mock"`` (uniform random tokens from the seed)
or a path / folder / glob / Megatron prefix; ``data.paths`` adds more of the latter, in order. Megatron
datasets are taken as they are (already tokenized; ``primus data prepare`` appends EOS to each document, so
a prepared .jsonl gives the very stream the .jsonl itself gives). Documents that tokenize to nothing are
skipped, as Megatron's preprocessing does.

Tokenized streams are cached as ``<cache>/tokens/<key>.npy``; the key covers every input file's path, size
and mtime, the tokenizer's full definition and ``data.text_key``. The first rank builds the file under a lock
and renames it into place; the other ranks wait and memory-map the same file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from primus.core.data import corpus
from primus.core.data.cache import atomic_write, cache_root, file_lock
from primus.core.data.documents import Input, iter_documents, resolve_inputs
from primus.core.data.errors import DataError
from primus.core.data.indexed import IndexedReader
from primus.core.data.tokenizer import encode_documents, eos_id, load_tokenizer, tokenizer_hash

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from primus.core.config.schema import DataConfig

#: Tokens in the "mock" stream: 2**20, e.g. 1000 steps of 8 x 128 tokens before it wraps.
MOCK_TOKENS = 1 << 20
#: Bump when the stream layout changes, to retire old cache entries.
STREAM_VERSION = 1


def load_token_stream(data_cfg: DataConfig, tokenizer: Tokenizer | None, vocab_size: int, seed: int = 0) -> np.ndarray:
    """All documents of ``data_cfg``'s source as one int32 array, each followed by the EOS token.

    ``tokenizer`` may be None: ``data_cfg.tokenizer`` is then loaded when the source needs one. ``seed`` only
    matters for ``"mock"``; sample order is the loader's business. The result is read-only (memory-mapped
    from the cache) for every source but ``"mock"``.

    :raises DataError: for missing or unreadable inputs, and for token ids >= ``vocab_size``.
    """
    if data_cfg.source == "mock":
        return np.random.default_rng(seed).integers(0, vocab_size, size=MOCK_TOKENS, dtype=np.int32)

    inputs = source_inputs(data_cfg)
    needs_text = needs_tokenizer(data_cfg, inputs)
    if needs_text:
        tokenizer = text_tokenizer(data_cfg, tokenizer, vocab_size)

    key = {
        "v": STREAM_VERSION,
        "bundled": corpus.corpus_id() if data_cfg.source == "bundled" else None,
        "tokenizer": tokenizer_hash(tokenizer) if needs_text else None,
        "text_key": data_cfg.text_key,
        "inputs": [input_fingerprint(item) for item in inputs],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_root() / "tokens" / f"{digest}.npy"

    with file_lock(path):
        stream = _load_cached(path)
        if stream is None:
            built = _build(data_cfg, inputs, tokenizer)
            atomic_write(path, lambda tmp: _save(tmp, built))
            stream = _load_cached(path)
            assert stream is not None, path

    if stream.size:
        check_token_ids(data_cfg, int(stream.max()), vocab_size)
    return stream


def source_inputs(data_cfg: DataConfig, key: str = "data.source", paths_key: str = "data.paths") -> list[Input]:
    """The files of ``data.source`` (unless "bundled") and ``data.paths``, in order; none for "mock" (random
    tokens, the paths unused). ``key`` / ``paths_key`` name them in errors (``eval.source``, ``data.blend[0].path``).

    :raises DataError: naming the key and path: no such file / folder / prefix, an unknown extension, an empty
        folder, a glob matching nothing, half a Megatron pair.
    """
    if data_cfg.source == "mock":
        return []
    specs = [(p, f"{paths_key}[{i}]") for i, p in enumerate(data_cfg.paths)]
    if data_cfg.source != "bundled":
        specs.insert(0, (data_cfg.source, key))
    return resolve_inputs(specs, data_cfg.format) if specs else []


def needs_tokenizer(data_cfg: DataConfig, inputs: list[Input]) -> bool:
    """Whether the stream is tokenized here (text), not read as tokens (Megatron .bin/.idx, "mock")."""
    return data_cfg.source == "bundled" or any(item.format != "megatron" for item in inputs)


def text_tokenizer(data_cfg: DataConfig, tokenizer: Tokenizer | None, vocab_size: int) -> Tokenizer:
    """``tokenizer``, or ``data.tokenizer`` loaded, once its ids are known to fit ``model.vocab_size``."""
    if tokenizer is None:
        tokenizer = load_tokenizer(data_cfg.tokenizer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise DataError(
            f"tokenizer {data_cfg.tokenizer!r} has {size} tokens but model.vocab_size is "
            f"{vocab_size}: token ids must be < vocab_size (raise model.vocab_size)"
        )
    return tokenizer


def check_token_ids(data_cfg: DataConfig, max_id: int, vocab_size: int) -> None:
    if max_id >= vocab_size:
        raise DataError(
            f"{data_cfg.source}: token id {max_id} >= model.vocab_size {vocab_size} "
            "(the data was tokenized with a larger vocabulary than the model's)"
        )


def input_fingerprint(item: Input) -> list:
    files = []
    for path in item.files():
        stat = path.stat()
        files.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return [item.format, files]


def _build(data_cfg: DataConfig, inputs: list[Input], tokenizer: Tokenizer | None) -> np.ndarray:
    parts: list[np.ndarray] = []
    eos = np.asarray([eos_id(tokenizer)], dtype=np.int32) if tokenizer is not None else None
    if data_cfg.source == "bundled":
        parts += _with_eos(encode_documents(tokenizer, corpus.documents()), eos)
    for item in inputs:
        if item.format == "megatron":
            parts.append(np.asarray(IndexedReader(item.path).tokens, dtype=np.int32))
        else:
            parts += _with_eos(encode_documents(tokenizer, iter_documents(item, data_cfg.text_key)), eos)
    if not parts:
        raise DataError(f"{data_cfg.source}: the inputs hold no documents")
    return np.concatenate(parts).astype(np.int32, copy=False)


def _with_eos(docs, eos: np.ndarray) -> list[np.ndarray]:
    out = []
    for ids in docs:
        if ids.size:
            out += [ids, eos]
    return out


def _save(tmp: Path, stream: np.ndarray) -> None:
    with open(tmp, "wb") as handle:  # a file object: np.save would append .npy to a bare path
        np.save(handle, stream, allow_pickle=False)


def _load_cached(path: Path) -> np.ndarray | None:
    if not path.is_file():
        return None
    try:
        stream = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError):  # damaged entry: rebuild it
        return None
    return stream if stream.dtype == np.int32 and stream.ndim == 1 else None
