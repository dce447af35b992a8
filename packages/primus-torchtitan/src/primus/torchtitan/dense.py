"""Primus's own model registration: torchtitan's llama3 Transformer plus the two things it lacks.

- ``qkv_bias``: bias on the q/k/v projections (Qwen2.5). Attention is otherwise Llama's (GQA, RoPE, SDPA).
- ``tie_word_embeddings``: the output head shares the input embedding (Llama 3.2 1B/3B, small Qwen2.5).

Single-device model code only: parallelism is torchtitan's ``parallelize_llama`` and ``pipeline_llm``;
for a tied model, :func:`primus.torchtitan.compat.tied_embedding_fsdp_group` puts the embedding in the
output head's FSDP group (torch refuses a parameter shared by two groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from primus.torchtitan import compat

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.models.llama3 import Transformer, TransformerModelArgs  # noqa: E402


@dataclass
class DenseModelArgs(TransformerModelArgs):
    qkv_bias: bool = False
    tie_word_embeddings: bool = False


class DenseTransformer(Transformer):
    def __init__(self, model_args: DenseModelArgs) -> None:
        super().__init__(model_args)
        if model_args.qkv_bias:
            for block in self.layers.values():
                attn = block.attention
                for name in ("wq", "wk", "wv"):
                    old = getattr(attn, name)
                    setattr(attn, name, nn.Linear(old.in_features, old.out_features, bias=True))
        if model_args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        if self.model_args.tie_word_embeddings:
            # ``to_empty`` from the meta device gives each module its own copy: tie again before initialising
            # (the output head's init, run last, is the one the shared weight keeps, as in torchtitan's qwen3)
            self.output.weight = self.tok_embeddings.weight
        super().init_weights(buffer_device=buffer_device)
        if self.model_args.qkv_bias:
            for block in self.layers.values():
                for name in ("wq", "wk", "wv"):
                    nn.init.zeros_(getattr(block.attention, name).bias)


def parallelize_dense(parallelize_fn: Any):
    """torchtitan's parallelize function, with a tied embedding grouped with the output head under FSDP."""

    def parallelize(model: DenseTransformer, parallel_dims: Any, job_config: Any) -> nn.Module:
        if not model.model_args.tie_word_embeddings:
            return parallelize_fn(model, parallel_dims, job_config)
        with compat.tied_embedding_fsdp_group(model):
            return parallelize_fn(model, parallel_dims, job_config)

    return parallelize
