"""The run's kernel providers (``ctx.kernels``) swapped into torchtitan's model and loss.

Each swap keeps torchtitan's module object, its parameters and its name (only its class changes, to a
subclass whose ``forward`` calls the provider), so state-dict keys, checkpoints, TP plans, FSDP groups
and activation checkpointing see the same model:

- ``rms_norm``: every ``nn.RMSNorm`` (block norms, final norm, qwen3's q/k norms) → ``ProviderRMSNorm``.
- ``swiglu``: the FeedForward's ``silu(w1 x) * w3 x`` → ``provider(w1 x, w3 x)``.
- ``attention``: ``attention.inner_attention`` (torchtitan's SDPA wrapper) → ``ProviderAttention``
  (q, k, v ``[b, h, s, d]``, the core contract); under context parallelism → ``ContextParallelAttention``, the
  provider's context-parallel entry point (primus-turbo's ring attention) on torchtitan's sequence shards; in qwen3
  under TP → ``HeadShardedAttention``, the provider on each rank's heads (qwen3 hands DTensors sharded by head).
- ``cross_entropy``: the TrainSpec's loss (token-sum, as torchtitan's) → provider mean × valid tokens.
- ``linear_cross_entropy`` (when the cross_entropy provider offers it): the model's ``output`` projection
  and the loss become one fused call that never materialises the logits (:mod:`primus.torchtitan.loss`);
  not under PP, CP or TP (reasons in :func:`plan`), where the plain provider loss above applies.
- ``grouped_gemm``: the MoE experts (``GroupedExperts``, stacked ``w1 / w2 / w3``) → ``ProviderGroupedExperts``:
  three provider grouped GEMMs (torchtitan's own runs ``torch._grouped_mm`` in bf16 on a GPU, a loop on CPU).
- ``moe_permute``: the MoE layer (``MoE``) → ``ProviderMoE``: the tokens' gather into the experts' order and the
  weighted combine back by the provider (the router, reorderer, experts and all-to-alls stay torchtitan's).
- ``moe_router``: the router (``TokenChoiceTopKRouter``) → ``ProviderRouter``: scores, top-k and weights after its
  gate by the provider.
- ``rope`` is never swapped: torchtitan's llama3 rotates interleaved pairs (complex ``freqs_cis``) where
  the provider contract is rotate-half, and qwen3's rotate-half RoPE is inline in its Attention.forward.

Not swapped (torchtitan's own modules stay, with the reason logged): core's reference providers
(torchtitan's modules compute the same math, with torch's fused kernels), ops that see DTensors under
tensor parallelism (norms; the loss with loss parallelism; qwen3's attention under TP × CP), attention under context
parallelism when the provider has no context-parallel entry point (torch's own context-parallel SDPA runs, GPU
only).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from primus.core.kernels import reference
from primus.core.planner.engine_profile import fused_loss_refusal
from primus.torchtitan import compat
from primus.torchtitan.loss import fuse_output, head_loss, token_sum

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402
from torchtitan.models.attention import ScaledDotProductAttentionWrapper  # noqa: E402
from torchtitan.models.moe.moe import GroupedExperts, MoE, TokenChoiceTopKRouter  # noqa: E402
from torchtitan.models.moe.utils import indices_padding_wrapper  # noqa: E402

log = logging.getLogger("primus.torchtitan")

# swapped in the model; cross_entropy in the loss
MODULE_OPS = ("attention", "rms_norm", "swiglu", "grouped_gemm", "moe_permute", "moe_router")
SWAPPED_OPS = (*MODULE_OPS, "cross_entropy")

# what torchtitan's own module computes for each op: core's reference provider of that op
REFERENCE = {
    "attention": reference.attention,
    "rms_norm": reference.rms_norm,
    "swiglu": reference.swiglu,
    "cross_entropy": reference.cross_entropy,
    "rope": reference.rope,
    "grouped_gemm": reference.grouped_gemm,
    "moe_permute": reference.moe_permute,
    "moe_router": reference.moe_router,
}


@dataclass(frozen=True)
class Choice:
    """What the run applies for one op: the provider's callable (None: torchtitan's own module) and why."""

    op: str
    provider: str
    fn: Callable[..., Any] | None
    note: str
    documents: bool = False  # attention: masks by document (data.document_mask)
    context_parallel: bool = False  # attention: the provider's context-parallel entry point (parallel.cp > 1)
    heads_sharded: bool = False  # attention: q, k, v come as DTensors sharded by head (qwen3 under TP)

    def describe(self) -> str:
        return f"{self.op}: {self.provider} → {'swapped in' if self.fn else 'torchtitan module'} ({self.note})"


def plan(
    providers: dict[str, Any],
    *,
    family: str,
    tp: int,
    cp: int,
    loss_parallel: bool,
    pp: int = 1,
    swap_reference: bool = False,
    fp8_head: bool = False,
    documents: bool = False,
) -> dict[str, Choice]:
    """Decide per op whether the selected provider replaces torchtitan's module (``providers``: op →
    :class:`~primus.core.contracts.protocols.KernelProvider`). ``swap_reference`` swaps core's reference providers
    too (tests of the mechanism); normally torchtitan's modules already compute them. ``fp8_head``: the output
    head becomes an FP8 linear (``kernels.fp8_recipe.bf16_output_head: false``), so it is not fused with the loss
    (the fused kernel would run it in bf16 and leave the FP8 module unused). ``documents`` (``data.document_mask``):
    the attention provider is swapped in whatever it is (torchtitan's SDPA module cannot mask by document)."""
    out: dict[str, Choice] = {}
    dtensor = {
        "rms_norm": "norms run on DTensors under tensor parallelism (sequence parallel)" if tp > 1 else "",
        "cross_entropy": "the loss runs on DTensors under loss parallelism" if tp > 1 and loss_parallel else "",
        "attention": "qwen3's attention runs on DTensors of the TP mesh, which torch's context-parallel plan does "
        "not shard"
        if tp > 1 and family == "qwen3" and cp > 1
        else "",
        "swiglu": "",
        "grouped_gemm": "",  # the experts take their weights' local shards (to_local), as torchtitan's own
        "moe_permute": "",  # the MoE layer's input is a local tensor in every layout (replicated under TP)
        "moe_router": "",  # the gate's output is local (its TP style returns local tensors)
    }
    for op, prov in providers.items():
        if op == "rope":
            why = (
                "qwen3's rotate-half RoPE is inline in torchtitan's Attention.forward"
                if family == "qwen3"
                else "torchtitan's llama3 RoPE rotates interleaved pairs, the provider contract is rotate-half"
            )
            out[op] = Choice(op, prov.name, None, why)
            continue
        if op not in SWAPPED_OPS:
            continue
        fn = prov.load()
        if op == "attention" and cp > 1 and not dtensor[op]:
            out[op] = _context_parallel_choice(prov.name, fn)
        elif op == "attention" and tp > 1 and family == "qwen3" and cp == 1:
            # swapped even for core's reference: torch has no DTensor rule for SDPA's CPU flash kernel
            why = "qwen3 hands TP-sharded DTensors: the provider runs on each rank's heads"
            out[op] = Choice(op, prov.name, fn, why, documents=documents, heads_sharded=True)
        elif op == "attention" and documents and not dtensor[op]:
            out[op] = Choice(op, prov.name, fn, "masks by document (data.document_mask)", documents=True)
        elif fn is REFERENCE[op] and not swap_reference:
            out[op] = Choice(op, prov.name, None, "core's reference: torchtitan's module computes the same")
        elif dtensor[op]:
            out[op] = Choice(op, prov.name, None, dtensor[op])
        else:
            out[op] = Choice(op, prov.name, fn, "provider")
    fused = getattr(out["cross_entropy"].fn, "linear_cross_entropy", None) if "cross_entropy" in out else None
    if fused is not None:
        name = out["cross_entropy"].provider
        why = fused_head_refusal(tp=tp, pp=pp, cp=cp, fp8_head=fp8_head)
        out["linear_cross_entropy"] = Choice("linear_cross_entropy", name, None if why else fused, why or "provider")
    return out


def _context_parallel_choice(name: str, fn: Callable[..., Any]) -> Choice:
    """Attention over a sequence split by ``parallel.cp``: the provider's context-parallel entry point (its
    ``context_parallel`` feature) on the shards torchtitan hands in, else torch's own context-parallel SDPA on
    torchtitan's module (which needs a GPU: torch has no DTensor rule for CPU flash attention)."""
    entry = getattr(fn, "context_parallel", None)
    if entry is None:
        return Choice("attention", name, None, "torch's context-parallel SDPA wraps torchtitan's module")
    return Choice(
        "attention", name, entry, "context-parallel attention on torchtitan's sequence shards", context_parallel=True
    )


def fused_head_refusal(*, tp: int, pp: int, cp: int, fp8_head: bool = False) -> str:
    """Why the output projection + loss cannot be fused in this layout ("" where they can)."""
    why = fused_loss_refusal("torchtitan", tp=tp, pp=pp, cp=cp, fp8_head=fp8_head)
    return f"{why}: provider loss on the logits" if why else ""


# ------------------------------------------------------------------------------------------------ modules


class ProviderRMSNorm(nn.RMSNorm):
    """torchtitan's ``nn.RMSNorm`` (same ``weight``), computed by the rms_norm provider."""

    kernel: Callable[..., torch.Tensor]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return self.kernel(x, self.weight, eps)


class ProviderAttention(ScaledDotProductAttentionWrapper):
    """torchtitan's SDPA wrapper (same call), computed by the attention provider."""

    kernel: Callable[..., torch.Tensor]

    documents: torch.Tensor | None = None  # [b, s], set by the enclosing attention module for its forward

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
    ) -> torch.Tensor:
        return self.attend(q, k, v, causal=is_causal, scale=scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
        if self.documents is not None:
            return self.kernel(q, k, v, documents=self.documents, **options)
        return self.kernel(q, k, v, **options)


class ContextParallelAttention(ProviderAttention):
    """torchtitan's SDPA wrapper under context parallelism, computed by the provider's context-parallel entry
    point (``fn(q, k, v, group=, causal=, scale=)`` on local shards, core's ``[b, h, s_local, d]`` layout).

    torchtitan applies torch's context-parallel plan to this module (``apply_cp_to_attention_module``): its hooks
    hand q, k, v in as DTensors sharded on the sequence over the cp mesh and take the result back as a plain
    tensor. Each rank's shard is in torch's head-tail order, chunks ``r`` and ``2·cp-1-r`` of ``2·cp``
    (``_HeadTailLoadBalancer``, torchtitan's default ``context_parallel_load_balancer``), which is megatron's
    layout and the one the provider expects; RoPE positions are sharded the same way by torchtitan."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
        if not isinstance(q, DTensor):
            raise RuntimeError(
                "context-parallel attention expects q, k, v as DTensors sharded over the cp mesh "
                "(torchtitan's context-parallel plan on this module); got a plain tensor"
            )
        group = q.device_mesh.get_group()
        q, k, v = (x.to_local() for x in (q, k, v))
        return self.kernel(q, k, v, group=group, **options)


class HeadShardedAttention(ProviderAttention):
    """torchtitan's SDPA wrapper in qwen3 under tensor parallelism, computed by the provider on each rank's heads.

    qwen3's TP plan keeps q, k, v as DTensors sharded on the head dim (its per-head q/k norms run on them); attention
    is independent per head and a rank's query heads map onto its own KV heads (both split in contiguous blocks), so
    the provider runs on the local shards and the output goes back as a DTensor of the same placements, as torch's
    DTensor SDPA would return it (which has no rule for the CPU flash kernel)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
        if not isinstance(q, DTensor):
            return super().attend(q, k, v, **options)
        mesh, placements = q.device_mesh, q.placements
        by_head = all(p.is_shard(1) or p.is_replicate() for p in placements)
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not by_head or not isinstance(x, DTensor) or x.placements != placements:
                got = x.placements if isinstance(x, DTensor) else "a plain tensor"
                raise RuntimeError(f"head-sharded attention: {name} must be sharded on the head dim as q is: {got}")
        out = super().attend(q.to_local(), k.to_local(), v.to_local(), **options)
        return DTensor.from_local(out, mesh, placements, run_check=False)


@functools.cache
def _document_attention_class(base: type) -> type:
    """A subclass of torchtitan's Attention (llama3's or qwen3's) that takes ``attention_masks`` = ``[b, s]``
    document ids (:meth:`PrimusTrainer.post_dataloading_process <primus.torchtitan.trainer.PrimusTrainer>`) with
    its SDPA path: torchtitan's forward runs unchanged (it accepts masks only for flex / varlen attention, which need
    a GPU), while its provider attention module masks by them."""

    def forward(self, x, freqs_cis, attention_masks=None, positions=None):  # noqa: ANN001, ANN202
        self.inner_attention.documents = attention_masks
        try:
            return base.forward(self, x, freqs_cis, None, positions)
        finally:
            self.inner_attention.documents = None

    return type(f"Document{base.__name__}", (base,), {"forward": forward, "__module__": __name__})


class ProviderGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` (same stacked ``w1 / w2 / w3`` ``[experts, out, in]``, the provider
    contract's layout), computed by the grouped_gemm provider: ``w2(silu(w1 x) * w3 x)`` per expert. Without expert
    parallelism on a GPU torchtitan's index padding runs first (each expert's rows a multiple of 8: the
    16-byte alignment the grouped kernels' weight gradient needs), as for its own grouped GEMMs; under EP its
    dispatch pads."""

    kernel: Callable[..., torch.Tensor]

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        dtensor = isinstance(self.w1, DTensor)
        w1, w2, w3 = (w.to_local() if dtensor else w for w in (self.w1, self.w2, self.w3))
        gemm = self.kernel

        def run(w1, w2, w3, x, num_tokens_per_expert):  # noqa: ANN001, ANN202 - torchtitan's experts signature
            offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
            return gemm(reference.swiglu(gemm(x, w1, offs), gemm(x, w3, offs)), w2, offs)

        expert_parallel = dtensor and "ep" in (self.w1.device_mesh.mesh_dim_names or ())
        if x.device.type != "cpu" and not expert_parallel:
            run = indices_padding_wrapper(run)
        return run(w1, w2, w3, x, num_tokens_per_expert)


class ProviderMoE(MoE):
    """torchtitan's ``MoE`` layer (same router, reorderer, experts and shared experts, called as its forward calls
    them), with the tokens' gather into the experts' order and the weighted combine back computed by the moe_permute
    provider: torchtitan's ``x[order // k]`` and its zeros + index_put + fp32 batched product become the provider's
    ``moe_permute`` and ``unpermute`` (primus-turbo's Triton row gathers, no scatter in either direction). The
    scores weight the experts' outputs (``score_before_experts=False``, as Primus builds the model); the other order
    runs torchtitan's forward."""

    kernel: Callable[..., torch.Tensor]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.score_before_experts:
            return super().forward(x)
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)
        with torch.no_grad():  # the expert-bias update's counts, as torchtitan keeps them
            self.tokens_per_expert.add_(num_tokens_per_expert)
        _, order, num_tokens_per_expert = self.reorderer(top_scores, selected_experts_indices)
        k = self.router.top_k
        routed_output = self.experts(self.kernel(x, order, k), num_tokens_per_expert)
        out = self.shared_experts(x) if self.shared_experts is not None else None
        out_experts = self.kernel.unpermute(routed_output, order, top_scores.reshape(-1, k)).to(x.dtype)
        return (out_experts if out is None else out + out_experts).reshape(bs, slen, dim)


class ProviderRouter(TokenChoiceTopKRouter):
    """torchtitan's top-k router (same gate, options and outputs), its scores, top-k and weights computed by the
    moe_router provider in one call after the gate. Node-limited routing and the debug load balance run torchtitan's
    own forward."""

    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.num_expert_groups is not None or self._debug_force_load_balance:
            return super().forward(x, expert_bias)
        top_scores, selected_experts_indices = self.kernel(
            self.gate(x),
            self.top_k,
            score=self.score_func,
            bias=expert_bias,
            normalize=self.route_norm,
            scale=self.route_scale,
        )
        counts = torch.histc(selected_experts_indices.view(-1), bins=self.num_experts, min=0, max=self.num_experts)
        return top_scores, selected_experts_indices, counts


def _swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.w2(self.kernel(self.w1(x), self.w3(x)))


@functools.cache
def _swiglu_class(base: type) -> type:
    """A subclass of torchtitan's FeedForward (llama3's or qwen3's: ``w2(silu(w1 x) * w3 x)``)."""
    return type(f"Provider{base.__name__}", (base,), {"forward": _swiglu_forward, "__module__": __name__})


def _retype(module: nn.Module, cls: type, kernel: Callable[..., Any]) -> None:
    module.__class__ = cls
    module.kernel = kernel


def use_grouped_gemm(module: nn.Module, kernel: Callable[..., torch.Tensor]) -> None:
    """torchtitan's ``GroupedExperts`` (or a :class:`ProviderGroupedExperts`) onto the grouped GEMM ``kernel``."""
    _retype(module, ProviderGroupedExperts, kernel)


def _is_feed_forward(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in ("w1", "w2", "w3")) and not hasattr(
        module, "experts"
    )


def swap_modules(model: nn.Module, choices: dict[str, Choice]) -> dict[str, int]:
    """Retype the modules of ``model`` for the choices that carry a provider; returns op → modules swapped."""
    fns = {op: c.fn for op, c in choices.items() if c.fn is not None and op in MODULE_OPS}
    documents = "attention" in choices and choices["attention"].documents
    counts = dict.fromkeys(fns, 0)
    head = choices.get("linear_cross_entropy")
    if head is not None and head.fn is not None:
        counts["linear_cross_entropy"] = int(fuse_output(model, head.fn))
    for module in model.modules():
        if "rms_norm" in fns and type(module) is nn.RMSNorm and module.weight is not None:
            _retype(module, ProviderRMSNorm, fns["rms_norm"])
            counts["rms_norm"] += 1
        elif "attention" in fns and type(module) is ScaledDotProductAttentionWrapper:
            choice = choices["attention"]
            cls = ContextParallelAttention if choice.context_parallel else ProviderAttention
            cls = HeadShardedAttention if choice.heads_sharded else cls
            _retype(module, cls, fns["attention"])
            counts["attention"] += 1
        elif documents and isinstance(getattr(module, "inner_attention", None), ScaledDotProductAttentionWrapper):
            module.__class__ = _document_attention_class(type(module))
        elif "moe_router" in fns and type(module) is TokenChoiceTopKRouter:
            _retype(module, ProviderRouter, fns["moe_router"])
            counts["moe_router"] += 1
        elif "moe_permute" in fns and type(module) is MoE:
            _retype(module, ProviderMoE, fns["moe_permute"])
            counts["moe_permute"] += 1
        elif "grouped_gemm" in fns and type(module) is GroupedExperts:
            _retype(module, ProviderGroupedExperts, fns["grouped_gemm"])
            counts["grouped_gemm"] += 1
        elif "swiglu" in fns and _is_feed_forward(module) and type(module).forward is not _swiglu_forward:
            _retype(module, _swiglu_class(type(module)), fns["swiglu"])
            counts["swiglu"] += 1
    return counts


def swapping_parallelize(parallelize_fn: Callable[..., nn.Module], choices: dict[str, Choice]):
    """A TrainSpec ``parallelize_fn`` that swaps the modules first: torchtitan calls it on the model (or
    on each pipeline stage) after building it on the meta device, before TP, FSDP, AC and compile."""

    def parallelize(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
        swap_modules(model, choices)
        if (fp8 := choices.get("fp8")) is not None and fp8.fn is not None:
            fp8.fn(model)  # FP8 linears (primus.torchtitan.fp8), before TP / FSDP / AC / compile
        return parallelize_fn(model, parallel_dims, job_config)

    return parallelize


def provider_loss(cross_entropy: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """torchtitan's loss contract (the token *sum*, divided by the global token count by the trainer) from
    a provider returning the mean over valid tokens. A micro-batch without valid tokens sums to 0."""

    def loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_sum(cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1), ignore_index=IGNORE_INDEX), labels)

    return loss


def loss_builder(build_loss_fn: Callable[..., Any], choice: Choice | None, fused: Choice | None = None):
    """A TrainSpec ``build_loss_fn``: torchtitan's, or the provider's (compiled like torchtitan's when
    ``compile.components`` has ``loss``); with ``fused`` applied, the fused head's token-loss sum passes
    through it (:func:`primus.torchtitan.loss.head_loss`)."""
    if (choice is None or choice.fn is None) and (fused is None or fused.fn is None):
        return build_loss_fn

    def build(job_config: Any, **kwargs: Any) -> Callable[..., torch.Tensor]:
        if choice is None or choice.fn is None:
            fn = build_loss_fn(job_config, **kwargs)
        else:
            fn = provider_loss(choice.fn)
            if job_config.compile.enable and "loss" in job_config.compile.components:
                fn = torch.compile(fn, backend=job_config.compile.backend)
        return head_loss(fn) if fused is not None and fused.fn is not None else fn

    return build
