"""Document-aware attention in packed samples (``data.document_mask``): each token attends only to earlier tokens of
its own document.

Packed samples concatenate documents, each ended by the tokenizer's EOS token. ``document_ids(tokens, eos)`` numbers
each position's document (the EOS belongs to the document it ends), the same numbering on both engines and in
TorchTitan's own ``block_causal`` mask. An attention provider that can mask by document lists :data:`DOCUMENTS` in
its ``features`` and takes ``documents=`` (``[b, s]``, non-decreasing along ``s``); selection refuses the others
when the mask is asked for. Positions (RoPE) run on across documents, as in TorchTitan's ``block_causal``: RoPE's
scores depend only on the distance between query and key, so a document attended to alone scores as it would at
position 0 (up to rounding).

Packed fine-tuning chats (``data.sft_packing: packed``) carry their own document ids with each sample
(:mod:`primus.core.data.sft_packing`): a chat template may end every turn with the EOS token, so they are not
recomputed from EOS; a backend hands them to the attention as it hands :func:`document_ids`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from primus.core.contracts.protocols import DOCUMENTS

if TYPE_CHECKING:
    from primus.core.config.schema import PrimusConfig

__all__ = ["DOCUMENTS", "document_causal_mask", "document_eos", "document_ids", "masks_documents"]


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``[b, s]`` int32: the number of EOS tokens before each position (its document's index in the sample)."""
    ends = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(ends, dim=-1, dtype=torch.int32) - ends


def document_causal_mask(documents: torch.Tensor) -> torch.Tensor:
    """``[b, 1, s, s]`` bool, True where query ``i`` may attend to key ``j``: ``j <= i`` in the same document."""
    s = documents.shape[-1]
    same = documents[:, :, None] == documents[:, None, :]
    causal = torch.ones(s, s, dtype=torch.bool, device=documents.device).tril()
    return (same & causal)[:, None]


def masks_documents(cfg: PrimusConfig) -> bool:
    """Attention is masked by document: ``data.document_mask``, or fine-tuning chats packed with their document ids
    (``data.sft_packing: packed``); what kernel selection is asked for."""
    d = cfg.data
    return d.document_mask or (cfg.train.objective == "sft" and d.sft_packing == "packed")


def document_eos(cfg: PrimusConfig) -> int | None:
    """The token that ends a document when ``data.document_mask`` is on (the tokenizer's EOS), else None: what a
    backend passes to :func:`document_ids` for each batch."""
    if not cfg.data.document_mask:
        return None
    from primus.core.data import eos_id, load_tokenizer

    return eos_id(load_tokenizer(cfg.data.tokenizer))
