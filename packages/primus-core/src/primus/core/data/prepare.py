"""``primus data prepare``: tokenize .jsonl/.txt/.parquet files into a Megatron ``<prefix>.bin/.idx`` dataset.

One sequence per document, EOS appended by default, token dtype as Megatron's ``preprocess_data.py`` picks it
(uint16 below 65500 tokens, else int32). Written by megatron-core's own ``IndexedDatasetBuilder`` when
megatron-core is installed, by :class:`~primus.core.data.indexed.IndexedWriter` otherwise: the bytes are the
same. Both files are written under temporary names and renamed into place at the end.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from primus.core.data.documents import iter_documents, resolve_inputs
from primus.core.data.errors import DataError
from primus.core.data.indexed import IndexedWriter, bin_path, idx_path, optimal_dtype
from primus.core.data.tokenizer import encode_documents, eos_id, load_tokenizer

Writer = Literal["auto", "megatron", "numpy"]


@dataclass(frozen=True)
class PrepareResult:
    prefix: str
    documents: int
    tokens: int
    dtype: str
    writer: str  # "megatron" or "numpy": which code wrote the files


def _megatron_builder():
    try:
        with warnings.catch_warnings():  # megatron.core warns at import about optional Apex / TE
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    except ImportError:
        return None
    return IndexedDatasetBuilder


def prepare(
    inputs: list[str],
    tokenizer: str = "bundled",
    output: str = "data/prepared",
    text_key: str = "text",
    append_eos: bool = True,
    writer: Writer = "auto",
    progress: bool = True,
) -> PrepareResult:
    """Tokenize every document of ``inputs`` (files, folders, globs) into ``<output>.bin/.idx``."""
    if not inputs:
        raise DataError("prepare: no inputs given")
    items = resolve_inputs([(spec, f"input {spec!r}") for spec in inputs], text_only=True)
    for item in items:
        if item.format == "megatron":
            raise DataError(f"prepare: {item.path} is already a tokenized Megatron dataset")
    tok = load_tokenizer(tokenizer)
    dtype = optimal_dtype(tok.get_vocab_size(with_added_tokens=True))
    eos = eos_id(tok) if append_eos else None

    builder_cls = _megatron_builder() if writer in ("auto", "megatron") else None
    if writer == "megatron" and builder_cls is None:
        raise DataError("prepare: writer='megatron' needs megatron-core installed")
    used = "megatron" if builder_cls is not None else "numpy"

    prefix = Path(output).expanduser()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{prefix}.tmp-{os.getpid()}"
    if builder_cls is not None:
        sink = builder_cls(str(bin_path(tmp)), dtype=dtype)
    else:
        sink = IndexedWriter(tmp, dtype)

    documents = tokens = 0
    try:
        with _progress(progress, len(items)) as bar:
            task = bar.add_task("tokenizing", total=len(items))
            for item in items:
                bar.update(task, description=f"{item.path.name}")
                for ids in encode_documents(tok, iter_documents(item, text_key)):
                    if ids.size == 0:
                        continue  # like Megatron's preprocessing: empty documents are dropped
                    if eos is not None:
                        ids = np.append(ids, np.int32(eos))
                    sink.add_document(ids, [int(ids.size)])
                    documents += 1
                    tokens += int(ids.size)
                    if documents % 1000 == 0:
                        bar.update(task, description=f"{item.path.name}: {documents:,} docs, {tokens:,} tokens")
                bar.advance(task)
        if builder_cls is not None:
            sink.finalize(str(idx_path(tmp)))
        else:
            sink.finalize()
    except BaseException:
        for path in (bin_path(tmp), idx_path(tmp)):
            path.unlink(missing_ok=True)
        raise
    os.replace(bin_path(tmp), bin_path(prefix))
    os.replace(idx_path(tmp), idx_path(prefix))
    return PrepareResult(str(prefix), documents, tokens, np.dtype(dtype).name, used)


def _progress(enabled: bool, total: int):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("files"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=True,
    )
