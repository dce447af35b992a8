"""What a provider of each kernel op is called with and must return: the contract every provider of ``op`` keeps,
checked against core's plain-PyTorch reference (:mod:`primus.core.kernels.reference`).

One entry per op of :data:`primus.core.contracts.protocols.KERNEL_OPS`; the plugin author's reference (``docs/``) is generated
from this table, and a test fails when an op has no entry. Shapes: ``b`` batch, ``s`` sequence, ``h`` query heads,
``h_kv`` key/value heads, ``d`` head dim, ``n`` tokens (rows), ``D`` model width, ``F`` expert width, ``E`` experts,
``k`` experts per token, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpContract:
    signature: str
    returns: str
    notes: str


CONTRACTS: dict[str, OpContract] = {
    "attention": OpContract(
        "impl(q, k, v, *, causal=True, scale=None[, documents=None])",
        "[b, h, s, d], the dtype of q",
        "q [b, h, s, d]; k, v [b, h_kv, s, d] with h_kv dividing h (grouped-query attention: the provider broadcasts "
        "k/v heads); bf16, fp16 or fp32 (the dtype the engine computes in). scale None means 1/sqrt(d). Causal is "
        "top-left aligned (token i attends to tokens <= i). A provider with the feature 'documents' takes "
        "documents [b, s] (int, the document id of each token: causal within each document, data.document_mask); "
        "with 'context_parallel' it also offers impl.context_parallel(q, k, v, *, group, causal=True, scale=None) "
        "over a sequence split across group (each rank holds chunks r and 2*cp-1-r of 2*cp).",
    ),
    "rms_norm": OpContract(
        "impl(x, weight, eps)",
        "the shape and dtype of x",
        "x [..., D] (bf16 or fp32), weight [D]; x * rsqrt(mean(x**2, -1) + eps) * weight, accumulated in fp32.",
    ),
    "swiglu": OpContract(
        "impl(gate, up)",
        "the shape and dtype of gate",
        "gate, up [..., F], same dtype: silu(gate) * up (the projections stay the engine's linears).",
    ),
    "cross_entropy": OpContract(
        "impl(logits, target, ignore_index=-100)",
        "a scalar fp32 tensor: the MEAN loss over the tokens whose target is not ignore_index",
        "logits [..., V] (any float dtype; computed in fp32), target [...] int64. Engines that need a token sum "
        "multiply by the number of valid tokens. With the feature 'linear_cross_entropy' impl also offers "
        "impl.linear_cross_entropy(hidden [n, D], weight [V, D], target [n], ignore_index=-100): the same mean "
        "of (hidden @ weight.T) against target without materialising the logits.",
    ),
    "rope": OpContract(
        "impl(x, cos, sin)",
        "the shape and dtype of x",
        "x [b, s, h, d]; cos, sin [s, d]; rotate-half layout (GPT-NeoX / Hugging Face / Megatron non-interleaved): "
        "x * cos + cat(-x2, x1) * sin, with x1, x2 the two halves of the last dim.",
    ),
    "grouped_gemm": OpContract(
        "impl(x, w, offs)",
        "[n, F], the dtype of x (under autocast the matmul's dtype)",
        "x [n, D] rows sorted by expert; w [E, F, D] (one weight per expert, as nn.Linear stores it); offs [E] "
        "int32 cumulative row ends. Rows offs[g-1]:offs[g] are multiplied by w[g].T; rows past offs[-1] are zero. "
        "Differentiable in x and w.",
    ),
    "moe_permute": OpContract(
        "impl(x, order, k); impl.unpermute(routed, order, probs)",
        "permute: [n*k, D], x's dtype; unpermute: [n, D], routed's dtype",
        "x [n, D] tokens, order [n*k] int64: the token-expert slots in expert order (slot = token*k + j); "
        "permute gathers row order // k of x. unpermute puts routed [n*k, D] back in slot order and sums each "
        "token's k rows weighted by probs [n, k] in fp32.",
    ),
    "moe_router": OpContract(
        "impl(logits, k, *, score='softmax', bias=None, normalize=False, scale=1.0)",
        "(probs [n, k] fp32, indices [n, k] int64)",
        "logits [n, E] from the router's gate; scores are softmax or sigmoid in fp32; the top k are chosen on "
        "scores + bias (bias [E], loss-free balancing) and weighted by the scores; normalize makes each token's "
        "k weights sum to 1; then multiplied by scale.",
    ),
    "gemm": OpContract(
        "impl(model, recipe, skip=None) -> list[str]",
        "the qualified names of the linears it converted",
        "FP8 training linears (kernels.fp8): swaps every plain nn.Linear of model (bf16 weights) for an FP8 one "
        "under recipe (primus.core.kernels.fp8_recipe.Fp8Recipe), except the names skip holds; raises ValueError "
        "naming a layer whose dims the FP8 GEMM cannot take. With the feature 'fp8_grouped_gemm' it offers "
        "impl.grouped_gemm_for(recipe): the grouped_gemm contract with FP8 operands (the MoE experts).",
    ),
}
