"""Tokenizers: the bundled byte-level BPE (vocab 2048, trained on :mod:`.corpus`) or any ``tokenizer.json``.

The bundled tokenizer is trained on first use and cached at
``<cache>/tokenizers/bundled-<hash>/tokenizer.json``; the hash covers the corpus, the training settings and the
``tokenizers`` version, so a change to any of them builds a new one instead of reusing a stale file.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from primus.core.data import corpus
from primus.core.data.cache import atomic_write, cache_root, file_lock
from primus.core.data.errors import DataError

BUNDLED = "bundled"
VOCAB_SIZE = 2048
EOS = "<|endoftext|>"
PAD = "<|pad|>"
#: Bump when the training recipe below changes.
RECIPE_VERSION = 1

# End-of-document tokens of common tokenizer families, most specific first (Llama 3 has both
# <|end_of_text|> and <|eot_id|>: documents end with the former).
_EOS_NAMES = (EOS, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


def bundled_dir(root: Path | None = None) -> Path:
    """The cache folder of the bundled tokenizer for this interpreter and ``tokenizers`` version."""
    key = f"{RECIPE_VERSION}|{corpus.corpus_id()}|{VOCAB_SIZE}|{EOS}|{PAD}|{tokenizers.__version__}"
    return (root or cache_root()) / "tokenizers" / f"bundled-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def train_bundled() -> Tokenizer:
    """Train the bundled BPE from scratch (about a second). Same corpus and versions -> same tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS, PAD],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(corpus.documents(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise DataError(f"the bundled corpus gave a {tok.get_vocab_size()}-token BPE, not {VOCAB_SIZE}")
    return tok


def _load_bundled(root: Path | None = None) -> Tokenizer:
    path = bundled_dir(root) / "tokenizer.json"
    with file_lock(path):
        if path.is_file():
            try:
                return Tokenizer.from_file(str(path))
            except Exception:  # noqa: BLE001 - a damaged cache entry is rebuilt, not fatal
                pass
        tok = train_bundled()
        atomic_write(path, lambda tmp: tok.save(str(tmp)))
        # Reload: a trained tokenizer serializes differently from a loaded one, and caches key on to_str().
        return Tokenizer.from_file(str(path))


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bundled"``, a folder holding ``tokenizer.json``, or a ``tokenizer.json`` path.

    :raises DataError: naming the path when the file is missing or cannot be parsed.
    """
    if spec == BUNDLED:
        return _load_bundled()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"tokenizer folder {path.parent} has no tokenizer.json")
    elif not path.is_file():
        raise DataError(
            f"tokenizer {spec!r}: no such file or folder: {path} (expected 'bundled', a folder "
            "with tokenizer.json, or a tokenizer.json path)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for parse errors
        raise DataError(f"cannot read tokenizer file {path}: {exc}") from exc


def eos_id(tokenizer: Tokenizer) -> int:
    """The id of the end-of-document token (``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ...)."""
    for name in _EOS_NAMES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    raise DataError(f"the tokenizer has none of the end-of-document tokens {', '.join(_EOS_NAMES)}")


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """A digest of the tokenizer's full definition: the key token caches are stored under."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]


def encode_documents(tokenizer: Tokenizer, documents: Iterable[str], batch: int = 512) -> Iterator[np.ndarray]:
    """Token ids (int32) of each document, batched through the Rust encoder; no special tokens added
    (no BOS: documents are separated by EOS alone, as in GPT-style pretraining)."""
    for chunk in _batched(documents, batch):
        for encoding in tokenizer.encode_batch(list(chunk), add_special_tokens=False):
            yield np.asarray(encoding.ids, dtype=np.int32)


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:  # itertools.batched needs 3.12
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk
