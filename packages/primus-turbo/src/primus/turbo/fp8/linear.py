"""The FP8 linear: ``y = x · Wᵀ (+ b)`` with three ``torch._scaled_mm`` GEMMs.

Forward ``y = x·Wᵀ``: x and W in e4m3 (e4m3fnuz on the MI300 series, below). Backward ``dx = dy·W`` and ``dW = dyᵀ·x``: dy in the recipe's
grad dtype (e5m2 by default: more range for gradients), the other operand in e4m3. ``_scaled_mm`` wants
its first operand row-major and its second column-major (and on CUDA every dim a multiple of 16), and
scales along the reduction dim:

- tensorwise: one fp32 scale per operand; the forward's fp8 x and W are kept for backward and transposed
  there (an fp8 copy), so the saved activation is 1 byte per element instead of 2.
- rowwise: x scaled per row (token) and W per output row in the forward; backward re-quantizes along the
  other dim (dy per token for dgrad, W per input column; dyᵀ and xᵀ per column for wgrad), so x and W are
  saved in their own dtype. Output in bf16 (``_scaled_mm`` rowwise on CUDA requires it), cast after.

Master weights stay what they are (fp32 or bf16) and get their gradient in their own dtype; only the GEMM
operands are cast. Delayed scaling (tensorwise) keeps amax histories in :class:`Fp8State`, plain tensors
made on first use (not buffers: they are not model weights and never enter a checkpoint). Under tensor
parallelism the GEMMs run on the local shards (:func:`fp8_linear_tp`).

ROCm (written against torch's and AITER's APIs; **not run**: no AMD GPU here): ``torch._scaled_mm`` runs on
hipBLASLt there. The MI300 series (gfx942) multiplies AMD's fnuz formats (e4m3fnuz tops out at 240, not 448):
:func:`for_device` sets the recipe's ``fnuz`` from the GPU's architecture, and every cast follows
``recipe.forward_format`` / ``grad_format``. ``rocm_gemm: aiter`` sends the GEMMs with a bf16/fp16 output to
AITER's ``gemm_a8w8`` (CK; scales per row of each operand, so tensorwise scales are broadcast); the fp32 weight
gradients stay on hipBLASLt, which AITER's kernel does not write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without torch.distributed
    DTensor = None

from primus.turbo.fp8.device import compute_dtype, for_device
from primus.turbo.fp8.grouped import grouped_gemm_for, grouped_gemm_speedup
from primus.turbo.fp8.quantize import Impl, Quantized, quantize, resolve_impl
from primus.turbo.fp8.recipe import GEMM_ALIGN, Fp8Recipe


class Fp8State:
    """Delayed scaling's amax histories of one linear (x, W, dy): per role a ring of the last ``length`` amaxes
    (only their max is read, so a write position replaces rolling the history every call)."""

    ROLES = ("x", "w", "dy")

    def __init__(self, length: int) -> None:
        self.length = length
        self.history: dict[str, torch.Tensor] = {}
        self.next: dict[str, int] = {}

    def scale_amax(self, role: str, device: torch.device) -> torch.Tensor | None:
        """The amax to scale with: the history's max, or None until the history has a step in it."""
        hist = self.history.get(role)
        if hist is None:
            self.history[role] = torch.zeros(self.length, device=device, dtype=torch.float32)
            return None
        return hist.amax()

    def record(self, role: str, amax: torch.Tensor) -> None:
        i = self.next.get(role, 0)
        self.history[role][i] = amax.reshape(())
        self.next[role] = (i + 1) % self.length


def _quantize(t: torch.Tensor, fmt: str, role: str, recipe: Fp8Recipe, state: Fp8State | None, impl: Impl) -> Quantized:
    rowwise = recipe.mode == "rowwise"
    if recipe.scaling != "delayed" or state is None:
        return quantize(t, fmt, rowwise=rowwise, impl=impl)
    scale_amax = state.scale_amax(role, t.device)
    q = quantize(t, fmt, rowwise=False, amax=scale_amax, impl=impl)
    state.record(role, q.amax)
    return q


def aiter_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """``a [m, k] · bᵀ`` on AITER's ``gemm_a8w8``: ``XQ`` [m, k] and ``WQ`` [n, k] both row-major, fp32 scales
    ``x_scale`` [m, 1] and ``w_scale`` [1, n] applied to the product, output bf16 or fp16."""
    import aiter

    m, n = a.shape[0], b.shape[0]
    x_scale = scale_a.reshape(-1, 1).expand(m, 1).contiguous()
    w_scale = scale_b.reshape(1, -1).expand(1, n).contiguous()
    return aiter.gemm_a8w8(a.contiguous(), b.contiguous(), x_scale, w_scale, None, out_dtype)


@torch.library.custom_op("primus_turbo::scaled_mm", mutates_args=())
def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool,
    aiter: bool = False,
) -> torch.Tensor:
    """``a [m, k] · bᵀ`` (``b`` [n, k]) on ``torch._scaled_mm``, as one opaque op that makes its operands'
    layouts itself (first row-major, second column-major): under torch.compile inductor may hand it the fp8
    transposed copies in any layout. ``aiter``: on AITER's ``gemm_a8w8`` instead (bf16/fp16 outputs)."""
    if aiter and out_dtype in (torch.bfloat16, torch.float16):
        return aiter_scaled_mm(a, b, scale_a, scale_b, out_dtype)
    return torch._scaled_mm(
        a.contiguous(),
        b.contiguous().t(),
        scale_a=scale_a,
        scale_b=scale_b,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


@scaled_mm.register_fake
def _scaled_mm_shape(a, b, scale_a, scale_b, out_dtype, fast_accum, aiter=False):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _mm(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, *, rowwise: bool, fast_accum: bool, aiter: bool = False
) -> torch.Tensor:
    """``a.data [m, k] · b.dataᵀ`` where ``b.data`` is [n, k] row-major; scales (m, 1) and (1, n) rowwise,
    scalars tensorwise."""
    scale_b = b.scale_inv.reshape(1, -1) if rowwise else b.scale_inv
    dtype = torch.bfloat16 if rowwise else out_dtype
    y = scaled_mm(a.data, b.data, a.scale_inv, scale_b, dtype, fast_accum, aiter)
    # no same-dtype .to(): traced, it is a second node for the same tensor, an output aliasing an intermediate,
    # which torch 2.11's dynamo mis-routes gradients for (pytorch#180642): with it, the compiled block linears
    # trained on zero gradients on the H200; without it their gradients equal eager's (fp8_compile_check.py)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def _transposed(q: Quantized) -> Quantized:
    """The same tensorwise-scaled fp8 tensor, transposed into a contiguous copy."""
    return Quantized(q.data.t().contiguous(), q.scale_inv, q.amax)


def _both_layouts(
    t: torch.Tensor, fmt: str, rowwise: bool, *, write_q: bool = True
) -> tuple[Quantized | None, Quantized]:
    """``t`` [r, c] in fp8 scaled along c (None unless ``write_q``) and ``tᵀ`` [c, r] scaled along r, from one amax
    pass and one cast pass that writes both from each tile (Triton, :func:`.triton_grouped.quantize_experts`): what
    the GEMMs of one operand need, with no transposed copy of the bf16 tensor (a strided copy ran at a tenth of the
    memory bandwidth on an H100: 1.9 ms of an 8.4 ms fc1 of Llama 8B, benchmarks/fp8_linear_overhead.py). The scales
    come out of the kernel, so no small PyTorch ops follow it. Tensorwise: one scale, shared by both."""
    from primus.turbo.fp8 import triton_grouped

    q, qs, qt, qts = triton_grouped.quantize_experts(t[None], fmt, rowwise, write_q=write_q)
    if rowwise:
        first = Quantized(q[0], qs.view(-1, 1), qs) if write_q else None
        return first, Quantized(qt[0], qts.view(-1, 1), qts)
    scale_inv = qs.view(-1)[0]
    return (Quantized(q[0], scale_inv, scale_inv) if write_q else None), Quantized(qt[0], scale_inv, scale_inv)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe: Fp8Recipe, state: Fp8State | None, impl: Impl, out_dtype: torch.dtype):
        rowwise, fmt, aiter = recipe.mode == "rowwise", recipe.forward_format, recipe.rocm_gemm == "aiter"
        impl = resolve_impl(x, impl)  # here, not in backward (see resolve_impl)
        ctx.recipe, ctx.state, ctx.impl = recipe, state, impl
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        # Triton with current scaling: each operand's transposed fp8 copy comes with its first quantization; the
        # backward keeps xᵀ in fp8 (1 byte an element) and, tensorwise, Wᵀ (rowwise re-reads W: its backward scales
        # run along the other dim)
        ctx.fused = impl == "triton" and (recipe.scaling != "delayed" or state is None)
        if ctx.fused:
            xq, xtq = _both_layouts(x, fmt, rowwise)
            wq, wtq = _both_layouts(weight, fmt, rowwise)
            y = _mm(xq, wq, out_dtype, rowwise=rowwise, fast_accum=True, aiter=aiter)
            w_saved = (weight, weight) if rowwise else (wtq.data, wtq.scale_inv)
            ctx.save_for_backward(xtq.data, xtq.scale_inv, *w_saved)
            return y
        xq = _quantize(x, fmt, "x", recipe, state, impl)
        wq = _quantize(weight, fmt, "w", recipe, state, impl)
        y = _mm(xq, wq, out_dtype, rowwise=rowwise, fast_accum=True, aiter=aiter)
        if rowwise:
            ctx.save_for_backward(x, weight)
        else:
            ctx.save_for_backward(xq.data, xq.scale_inv, wq.data, wq.scale_inv)
        return y

    @staticmethod
    def backward(ctx, dy):
        recipe, state, impl = ctx.recipe, ctx.state, ctx.impl
        g, f, fast = recipe.grad_format, recipe.forward_format, recipe.fast_accum_backward
        rowwise = recipe.mode == "rowwise"
        mm = partial(_mm, fast_accum=fast, aiter=recipe.rocm_gemm == "aiter", rowwise=rowwise)
        dy = dy.contiguous()
        if ctx.fused:
            xtd, xts, wtd, wts = ctx.saved_tensors
            dyq, dytq = _both_layouts(dy, g, rowwise)
            wtq = _both_layouts(wtd, f, rowwise, write_q=False)[1] if rowwise else Quantized(wtd, wts, wts)
            dx = mm(dyq, wtq, ctx.x_dtype)
            dw = mm(dytq, Quantized(xtd, xts, xts), ctx.w_dtype)
            return dx, dw, None, None, None, None
        if rowwise:
            x, weight = ctx.saved_tensors
            dyq = quantize(dy, g, rowwise=True, impl=impl)
            wtq = quantize(weight.t().contiguous(), f, rowwise=True, impl=impl)  # per input column of W
            dx = mm(dyq, wtq, ctx.x_dtype)
            dytq = quantize(dy.t().contiguous(), g, rowwise=True, impl=impl)  # per output feature, over tokens
            xtq = quantize(x.t().contiguous(), f, rowwise=True, impl=impl)  # per input feature, over tokens
            dw = mm(dytq, xtq, ctx.w_dtype)
            return dx, dw, None, None, None, None
        xd, xs, wd, ws = ctx.saved_tensors
        dyq = _quantize(dy, g, "dy", recipe, state, impl)
        wt = _transposed(Quantized(wd, ws, ws))  # W [n, k] → [k, n]: dx = dy · W
        dx = mm(dyq, wt, ctx.x_dtype)
        dw = mm(_transposed(dyq), _transposed(Quantized(xd, xs, xs)), ctx.w_dtype)
        return dx, dw, None, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: Fp8Recipe,
    state: Fp8State | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with FP8 GEMMs (x [..., k], weight [n, k]); output and grads in the
    dtypes a bf16/fp32 linear would give."""
    out_dtype = compute_dtype(x)
    x2 = x.reshape(-1, x.shape[-1])
    with torch.autocast(x.device.type, enabled=False):
        y = _Fp8Linear.apply(x2.to(out_dtype), weight, recipe, state, impl, out_dtype)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(out_dtype)


def fp8_linear_tp(x, weight, bias, *, recipe: Fp8Recipe, state: Fp8State | None = None):
    """:func:`fp8_linear` on a tensor-parallel linear: ``weight`` a DTensor on a 1-D mesh, sharded by output rows
    (``Shard(0)``, torch's ColwiseParallel) or by input columns (``Shard(1)``, RowwiseParallel). The GEMMs run on
    the local shards, each shard quantized with its own scales (a shard's scale covers only what its GEMM
    multiplies); the output is the DTensor ``nn.Linear`` would give there: sharded on its last dim (colwise) or a
    partial sum (rowwise), which the parallel style's output layout then reduces or keeps.

    Backward: colwise, the local dgrad is one rank's share of a replicated input's gradient, so the input's local
    view takes ``Partial`` as its gradient placement (summed over the mesh when the caller redistributes); rowwise,
    the output's gradient arrives replicated and each rank's dgrad is its own input shard's. Weight gradients
    are the local shards' in both."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    mesh, (placement,) = weight.device_mesh, weight.placements
    if placement == Shard(0):
        x_in, x_grad, out = Replicate(), Partial(), Shard(x.dim() - 1)
    elif placement == Shard(1):
        x_in, x_grad, out = Shard(x.dim() - 1), Shard(x.dim() - 1), Partial()
    else:
        raise ValueError(f"fp8 tensor parallel: weight placement {placement} (expected Shard(0) or Shard(1))")
    if not isinstance(x, DTensor):  # a plain input is this rank's view under the expected layout
        x = DTensor.from_local(x, mesh, [x_in], run_check=False)
    elif x.placements != (x_in,):
        x = x.redistribute(mesh, [x_in])
    local_bias = bias.to_local() if bias is not None and placement == Shard(0) else None
    y = fp8_linear(x.to_local(grad_placements=[x_grad]), weight.to_local(), local_bias, recipe=recipe, state=state)
    y = DTensor.from_local(y, mesh, [out], run_check=False)
    return y if bias is None or placement == Shard(0) else y + bias


def _is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


class Float8Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict keys) whose GEMMs run in FP8; tensor-parallel (DTensor
    weights, see :func:`fp8_linear_tp`) or not."""

    fp8_recipe: Fp8Recipe
    fp8_state: Fp8State

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _is_dtensor(self.weight):
            return fp8_linear_tp(x, self.weight, self.bias, recipe=self.fp8_recipe, state=self.fp8_state)
        return fp8_linear(x, self.weight, self.bias, recipe=self.fp8_recipe, state=self.fp8_state)

    def extra_repr(self) -> str:
        r = self.fp8_recipe
        return f"{super().extra_repr()}, fp8={r.mode}, grad={r.grad_dtype}, scaling={r.scaling}"


def make_fp8(module: nn.Linear, recipe: Fp8Recipe) -> None:
    """Retype one ``nn.Linear`` in place (its parameters, hooks and name stay); ``recipe`` as
    :func:`for_device` made it."""
    module.__class__ = Float8Linear
    module.fp8_recipe = recipe
    module.fp8_state = Fp8State(recipe.amax_history)


def misaligned(module: nn.Linear) -> str:
    """Why ``_scaled_mm`` on CUDA cannot take this layer's dims ("" when it can)."""
    dims = (module.in_features, module.out_features)
    if any(d % GEMM_ALIGN for d in dims):
        return f"in/out features {dims} are not multiples of {GEMM_ALIGN}"
    return ""


Skip = Callable[[str, nn.Module], bool] | Iterable[str] | None


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe, skip: Skip = None) -> list[str]:
    """Swap every plain ``nn.Linear`` of ``model`` for :class:`Float8Linear` except those ``skip`` names
    (a set of qualified names, or a ``(name, module) -> bool`` predicate). Returns the names swapped.
    A layer whose dims ``_scaled_mm`` cannot take raises ValueError naming it."""
    if skip is None:
        skipped: Callable[[str, nn.Module], bool] = lambda name, module: False  # noqa: E731
    elif callable(skip):
        skipped = skip
    else:
        names = set(skip)
        skipped = lambda name, module: name in names  # noqa: E731
    recipe = for_device(recipe)
    swapped = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or skipped(name, module):
            continue
        if why := misaligned(module):
            raise ValueError(f"fp8: linear {name!r}: {why}")
        make_fp8(module, recipe)
        swapped.append(name)
    return swapped


# What an engine that keeps its own linear modules (megatron's tensor-parallel ones) takes from this provider:
# the provider's impl is convert_to_fp8, and the function and state it is built on ride along with it; and what a
# mixture-of-experts model's experts run on.
convert_to_fp8.fp8_linear = fp8_linear
convert_to_fp8.Fp8State = Fp8State
convert_to_fp8.for_device = for_device
convert_to_fp8.grouped_gemm_for = grouped_gemm_for
convert_to_fp8.grouped_gemm_speedup = grouped_gemm_speedup
