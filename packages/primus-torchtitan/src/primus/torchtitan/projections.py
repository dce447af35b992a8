"""q/k/v and gate/up projections as one GEMM each (``kernels.fuse_projections``).

torchtitan's llama3 runs ``wq``, ``wk`` and ``wv`` (and the MLP's ``w1`` and ``w3``) as separate linears of one
input; megatron-core runs each group as one GEMM over the concatenated weights. The modules here keep their
linears and parameters (state-dict keys, checkpoints, FSDP groups and activation checkpointing see the same
model): only the module's class changes, to a subclass whose forward concatenates the group's weights (a few
MB per layer) and runs one GEMM whose output it splits in views. Autograd then sums no input gradients: the
backward is one data-gradient and one weight-gradient GEMM per group. On the H200, fwd + bwd of the q/k/v group
ran 1.06-1.18x faster fused, gate/up 1.0-1.06x (``benchmarks/results/projection_fusion.json``).

A group is fused only where its linears are plain ``nn.Linear`` with all or none biased, so FP8 linears (swapped
in before this) keep their own GEMMs. Not under tensor parallelism: the weights become DTensor shards there and
their concatenation would gather them (:func:`refusal`). The attention forward is torchtitan 0.2.2's llama3
``Attention.forward`` for ``attn_type == "sdpa"`` with its three projections fused (other attention types keep
torchtitan's); ``tests/test_projections.py`` holds it to torchtitan's own outputs and gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from primus.torchtitan import compat
from primus.torchtitan.kernels import is_feed_forward

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.models.llama3.model.model import Attention, apply_rotary_emb  # noqa: E402


def refusal(*, tp: int) -> str:
    """Why this layout cannot fuse the projections ("" where it can)."""
    return "the linears are DTensor shards under tensor parallelism" if tp > 1 else ""


def project(x: torch.Tensor, linears: Sequence[nn.Linear]) -> list[torch.Tensor]:
    """``[lin(x) for lin in linears]`` as one GEMM: the outputs are views of one tensor."""
    weight = torch.cat([lin.weight for lin in linears])
    bias = torch.cat([lin.bias for lin in linears]) if linears[0].bias is not None else None
    return list(F.linear(x, weight, bias).split([lin.out_features for lin in linears], dim=-1))


def fusable(linears: Sequence[nn.Module]) -> bool:
    return all(type(lin) is nn.Linear for lin in linears) and len({lin.bias is None for lin in linears}) == 1


class FusedAttention(Attention):
    """torchtitan 0.2.2's llama3 ``Attention`` (sdpa) with ``wq``, ``wk`` and ``wv`` run as one GEMM."""

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        attention_masks: object | None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = project(x, (self.wq, self.wk, self.wv))
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis, positions=positions)
        assert attention_masks is None
        output = self.inner_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), enable_gqa=self.enable_gqa
        )
        return self.wo(output.transpose(1, 2).contiguous().view(bs, seqlen, -1))


def _fused_feed_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = project(x, (self.w1, self.w3))
    kernel = getattr(self, "kernel", None)  # a swapped-in swiglu provider (primus.torchtitan.kernels)
    return self.w2(kernel(gate, up) if kernel is not None else F.silu(gate) * up)


@functools.cache
def _fused_feed_forward_class(base: type) -> type:
    return type(f"Fused{base.__name__}", (base,), {"forward": _fused_feed_forward, "__module__": __name__})


def fuse_projections(model: nn.Module) -> dict[str, int]:
    """Retype the attention and feed-forward modules of ``model`` whose projection groups can be fused;
    returns how many of each."""
    counts = {"attention": 0, "feed_forward": 0}
    for module in model.modules():
        if type(module) is Attention and module.attn_type == "sdpa" and fusable((module.wq, module.wk, module.wv)):
            module.__class__ = FusedAttention
            counts["attention"] += 1
        elif (
            is_feed_forward(module)
            and type(module).forward is not _fused_feed_forward
            and fusable((module.w1, module.w3))
        ):
            module.__class__ = _fused_feed_forward_class(type(module))
            counts["feed_forward"] += 1
    return counts
