"""The data layer: tokenizers, token streams from every supported source, and packed training samples.

Importing this package imports numpy and tokenizers, never torch.
"""

from primus.core.data.errors import DataError
from primus.core.data.indexed import IndexedReader, write_indexed
from primus.core.data.packed import GlobalOrder, PackedDataset
from primus.core.data.sources import load_token_stream
from primus.core.data.tokenizer import eos_id, load_tokenizer

__all__ = [
    "DataError",
    "GlobalOrder",
    "IndexedReader",
    "PackedDataset",
    "eos_id",
    "load_token_stream",
    "load_tokenizer",
    "write_indexed",
]
