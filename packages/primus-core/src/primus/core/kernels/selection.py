"""Kernel selection: one provider per op, by name or ``auto`` (highest priority available here).

The call contract of each op (what ``provider.load()`` returns), shared by every provider:

- ``attention(q, k, v, *, causal=True, scale=None) -> out``: q ``[b, h, s, d]``, k/v ``[b, h_kv, s, d]``
  with ``h % h_kv == 0`` (GQA, never materialising repeated K/V where the kernel allows). A provider with the
  ``documents`` feature also takes ``documents=[b, s]`` (each position's document in a packed sample: attention
  stays causal within each document; :mod:`primus.core.kernels.documents`).
  A provider with the ``context_parallel`` feature also offers ``attention.context_parallel(q, k, v, *, group,
  causal=True, scale=None)`` over a sequence split across ``group`` (:data:`~primus.core.contracts.protocols.CONTEXT_PARALLEL`).
- ``rms_norm(x, weight, eps) -> y`` over the last dim.
- ``swiglu(gate, up) -> silu(gate) * up``. A provider may also offer ``swiglu.packed(x) -> swiglu(*x.chunk(2, -1))``
  (gate and up as the halves of one projection's output, the gradient returned in ``x``'s layout).
- ``cross_entropy(logits, target, ignore_index=-100) -> mean loss`` (fp32 accumulation).
  A provider may also offer ``cross_entropy.linear_cross_entropy(hidden [N, d], weight [V, d], target [N],
  ignore_index=-100) -> mean loss`` (an attribute of that callable): the output projection fused with the loss,
  never materialising the [N, V] logits; the backends then use it in place of their output layer + loss.
- ``rope(x, cos, sin) -> x`` rotate-half convention, x ``[b, s, h, d]``, cos/sin ``[s, d]``.
- ``grouped_gemm(x, w, offs) -> y``: mixture-of-experts' expert GEMMs in one call. x ``[T, K]`` holds the tokens
  sorted by expert, ``offs`` ``[G]`` int32 the cumulative ends of the groups (group ``g`` is rows
  ``offs[g-1]:offs[g]``), w ``[G, N, K]`` one ``nn.Linear`` weight per expert; y ``[T, N]`` with
  ``y[rows of g] = x[rows of g] @ w[g]ᵀ``, differentiable in x and w. Rows past ``offs[-1]`` (padding) are not
  defined.
- ``moe_permute(x, order, k) -> routed``: a mixture-of-experts layer's tokens copied into their experts' order.
  x ``[T, d]``; ``order`` ``[T·k]`` (int64) the token-expert slots (slot ``t·k + j``: token t's j-th expert) sorted
  by expert, as the engine's router computes it (a stable argsort); ``routed[i] = x[order[i] // k]``. Its attribute
  ``moe_permute.unpermute(routed, order, probs) -> out`` takes the experts' outputs back: ``out[t] = Σ_j probs[t, j]
  · routed[i]`` where ``order[i] = t·k + j`` (fp32 accumulation, ``routed``'s dtype). Both differentiable (x;
  routed and probs).
- ``moe_router(logits, k, *, score="softmax", bias=None, normalize=False, scale=1.0) -> (probs, indices)``: a
  mixture-of-experts router after its gate. logits ``[T, E]``; scores = softmax or sigmoid of them in fp32; each
  token's k experts are the top k of ``scores + bias`` (``bias`` ``[E]``: loss-free balancing's expert bias, selection
  only); ``probs`` ``[T, k]`` (fp32) their scores, divided by their sum when ``normalize``, times ``scale``;
  ``indices`` ``[T, k]`` int64. Differentiable in logits.

FP8 linears (``kernels.fp8`` not ``off``) are ``gemm`` providers picked by :func:`select_fp8` and returned
under the key ``"fp8"``; their impl is ``convert_to_fp8(model, recipe, skip) -> names swapped``. One that also offers
``convert_to_fp8.grouped_gemm_for(recipe) -> grouped_gemm`` (the ``grouped_gemm`` contract with FP8 operands; its
:data:`~primus.core.contracts.protocols.FP8_GROUPED_GEMM` feature) runs a mixture-of-experts model's experts in the FP8 blocks,
and ``convert_to_fp8.grouped_gemm_speedup() -> float | None``: its measured forward + backward speed over bf16's
grouped GEMM on this device at the experts' shapes (None: not measured here), which :func:`fp8_experts` reads.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from primus.core.contracts.errors import UserError
from primus.core.contracts.protocols import (
    CONTEXT_PARALLEL,
    DOCUMENTS,
    FP8_GROUPED_GEMM,
    KERNEL_OPS,
    Availability,
    ConfigIssue,
    KernelProvider,
)

if TYPE_CHECKING:
    from primus.core.config.schema import KernelsConfig, PrimusConfig
    from primus.core.contracts.plugins import Registry

log = logging.getLogger("primus.kernels")

SELECTABLE_OPS = tuple(op for op in KERNEL_OPS if op != "gemm")


class KernelUnavailable(UserError, RuntimeError):
    pass


def context_parallel_attention(registry: Registry) -> list[str]:
    """The installed attention providers that attend over a sequence split by ``parallel.cp`` (their
    :data:`~primus.core.contracts.protocols.CONTEXT_PARALLEL` feature), by name."""
    return [p.name for p in registry.providers("attention") if CONTEXT_PARALLEL in p.features]


def cp_attention_issues(cfg: PrimusConfig, registry: Registry, own: str | None = None) -> list[ConfigIssue]:
    """The context-parallel refusal every backend makes: under ``parallel.cp > 1`` the attention must attend over a
    sequence split across ranks, through a provider with the ``context_parallel`` feature (primus-turbo's ring
    attention) or the engine's own context-parallel attention (``own``: its reference provider's name, None where
    the engine has none). A provider that attends over the whole sequence on one device is refused by name."""
    cp = cfg.parallel.cp
    if cp <= 1:
        return []
    capable = context_parallel_attention(registry)
    if own is None and not capable:
        why = (
            "needs an attention provider with the context_parallel feature (primus-turbo's ring attention); "
            "none is installed"
        )
        return [ConfigIssue("parallel.cp", why, cp, "1, or install primus-turbo")]
    allowed = ["auto", *([own] if own else []), *capable]
    choice = cfg.kernels.attention
    if choice in allowed:
        return []
    why = (
        f"parallel.cp = {cp} splits the sequence (context parallelism); provider {choice!r} attends over the whole "
        "sequence on one device (it has no context_parallel feature)"
    )
    return [ConfigIssue("kernels.attention", why, choice, ", ".join(allowed))]


def detect_device() -> str:
    """``"cuda"``, ``"rocm"`` or ``"cpu"`` for this process (imports torch)."""
    import torch

    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return "cpu"


def _check(prov: KernelProvider, device: str, documents: bool, constraints: dict[str, object]) -> Availability:
    if prov.op != "attention":
        return prov.check(device, **constraints)
    if documents and DOCUMENTS not in prov.features:
        return Availability(False, "cannot mask attention by document (data.document_mask, data.sft_packing packed)")
    return prov.check(device, documents=documents, **constraints)


# ops only a mixture-of-experts model runs (not selected, not logged, for a dense one)
MOE_OPS = ("grouped_gemm", "moe_permute", "moe_router")


def select_kernels(
    kernels: KernelsConfig,
    registry: Registry,
    device: str,
    *,
    documents: bool = False,
    moe: bool = True,
    **constraints: object,
) -> dict[str, KernelProvider]:
    """Pick a provider per op; log each choice once. A provider asked for by name that cannot run
    here raises :class:`KernelUnavailable` with its reason. ``documents``: the attention masks by document
    (``data.document_mask``), which only providers with the :data:`~primus.core.contracts.protocols.DOCUMENTS` feature do
    (attention checks get it as a constraint too). ``moe``: the model has experts (else :data:`MOE_OPS` are left
    out)."""
    chosen: dict[str, KernelProvider] = {}
    for op in SELECTABLE_OPS:
        if op in MOE_OPS and not moe:
            continue
        want = getattr(kernels, op)
        providers = registry.providers(op)
        if want != "auto":
            prov = next((p for p in providers if p.name == want), None)
            if prov is None:
                raise KernelUnavailable(
                    f"kernels.{op}: no provider named {want!r} is installed "
                    f"(installed: {', '.join(p.name for p in providers) or 'none'})"
                )
            ok = _check(prov, device, documents, constraints)
            if not ok:
                raise KernelUnavailable(
                    f"kernels.{op}: provider {want!r} ({prov.dist}) is not available on {device}: {ok.reason}"
                )
            chosen[op] = prov
            log.info("%s: %s (asked for)", op, prov.name)
            continue
        reasons = []
        for prov in providers:
            ok = _check(prov, device, documents, constraints)
            if ok:
                chosen[op] = prov
                log.debug("%s: %s (auto)", op, prov.name)  # the run logs its choices in one line
                break
            reasons.append(f"{prov.name}: {ok.reason}")
        else:
            raise KernelUnavailable(
                f"kernels.{op}: no provider available on {device} ({'; '.join(reasons) or 'none installed'})"
            )
    if (fp8 := select_fp8(kernels, registry, device, moe=moe)) is not None:
        chosen["fp8"] = fp8
    return chosen


# fp8_recipe.implementation -> the gemm provider it names ("auto": the best available of both)
FP8_PROVIDERS = {"primus": "fp8", "torchao": "torchao"}


def select_fp8(kernels: KernelsConfig, registry: Registry, device: str, *, moe: bool = False) -> KernelProvider | None:
    """The FP8 linear provider for ``kernels.fp8`` (None when off); raises :class:`KernelUnavailable`
    naming why when none can run here. ``moe``: the model has experts, so only a provider with the
    :data:`~primus.core.contracts.protocols.FP8_GROUPED_GEMM` feature can run it."""
    if kernels.fp8 == "off":
        return None
    recipe = kernels.fp8_recipe
    constraints = {
        "mode": kernels.fp8,
        "scaling": recipe.scaling,
        "grad_dtype": recipe.grad_dtype,
        "rocm_gemm": recipe.rocm_gemm,
    }
    want = FP8_PROVIDERS.get(recipe.implementation)
    providers = [p for p in registry.providers("gemm") if p.name in FP8_PROVIDERS.values()]
    candidates = [p for p in providers if want in (None, p.name)]
    if not candidates:
        raise KernelUnavailable(
            f"kernels.fp8: no FP8 linear provider {want or ''} is installed "
            f"(installed: {', '.join(p.name for p in providers) or 'none'}; primus-turbo provides them)"
        )
    reasons = []
    for prov in candidates:
        if moe and FP8_GROUPED_GEMM not in prov.features:
            reasons.append(f"{prov.name}: has no FP8 grouped GEMM for a mixture-of-experts model's experts")
            continue
        ok = prov.check(device, **constraints)
        if ok:
            log.info("fp8: %s (%s, %s)", prov.name, kernels.fp8, "asked for" if want else "auto")
            return prov
        reasons.append(f"{prov.name}: {ok.reason}")
    raise KernelUnavailable(f"kernels.fp8={kernels.fp8}: cannot run on {device} ({'; '.join(reasons)})")


def fp8_experts(kernels: KernelsConfig, provider: KernelProvider) -> tuple[bool, str]:
    """Whether an MoE model's routed experts in the FP8 blocks run on ``provider``'s FP8 grouped GEMM, and why, for
    the kernel log. ``kernels.fp8_recipe.experts``: ``auto`` takes FP8 only where the provider measured it faster
    than bf16 on this device (a speed feature must not slow training), ``fp8`` forces it (with a warning when it is
    not measured faster), ``bf16`` keeps bf16."""
    from primus.core.kernels.fp8_recipe import FP8_EXPERTS_NOTE

    mode = kernels.fp8_recipe.experts
    if mode == "bf16":
        return False, "routed experts bf16 (kernels.fp8_recipe.experts: bf16)"
    speedup = provider.load().grouped_gemm_speedup()
    measured = "not measured on this device" if speedup is None else f"measured {speedup:.2f}x bf16's, fwd + bwd"
    if mode == "fp8":
        if speedup is None or speedup < 1.0:
            _warn_once(f"kernels.fp8_recipe.experts: fp8 forces FP8 grouped GEMMs for the experts ({measured})")
        return True, f"{FP8_EXPERTS_NOTE}, forced ({measured})"
    if speedup is not None and speedup >= 1.0:
        return True, f"{FP8_EXPERTS_NOTE} ({measured})"
    return False, (
        f"routed experts bf16: {provider.name}'s FP8 grouped GEMM is {measured}, not faster than bf16 "
        "(kernels.fp8_recipe.experts: fp8 forces it)"
    )


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)
