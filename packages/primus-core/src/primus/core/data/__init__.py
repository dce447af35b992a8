"""The data layer: tokenizers, token streams from every supported source, and packed training samples.

Its modules import numpy and tokenizers, never torch. The names below are imported from their modules
on first use."""

from primus.core.contracts.lazy import exports

_NAMES = {"errors": "DataError", "indexed": "IndexedReader write_indexed", "packed": "GlobalOrder PackedDataset"}
_NAMES |= {"sources": "load_token_stream", "tokenizer": "eos_id load_tokenizer"}
__all__, __getattr__ = exports(__name__, **_NAMES)
