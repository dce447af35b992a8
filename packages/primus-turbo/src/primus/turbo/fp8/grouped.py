"""FP8 grouped GEMM: a mixture-of-experts layer's expert GEMMs with e4m3 operands, the ``grouped_gemm`` contract
(x ``[T, K]`` sorted by expert, w ``[G, N, K]``, offs ``[G]`` int32 cumulative group ends; y ``[T, N]``).

Three GEMMs, as the FP8 linear's (:mod:`.linear`), each scaled along its reduction dim:

- forward ``y = x · W_gᵀ`` (2-D × 3-D): x per row (token), ``W_g`` per output row;
- dgrad ``dx = dy · W_g`` (2-D × 3-D): dy per row, ``W_g`` per input column;
- wgrad ``dW_g = dy_gᵀ · x_g`` (2-D × 2-D, the groups along the contraction): dy per (expert, output feature) and x
  per (expert, input feature), each over that expert's tokens ("jagged" scales).

``tensorwise`` takes one scale per activation and one per expert's weight matrix, broadcast into the same vectors
(the grouped kernel takes per-row scales only). Master weights, gradients and optimizer state keep their dtype.

Where it runs: ``torch._scaled_grouped_mm`` (one launch per GEMM for all experts) where torch runs it —
:func:`grouped_kernel_runs`, the rule of torch's own tests (CUDA sm90, H100 / H200; ROCm gfx942 / gfx950 in builds with
MSLK). Elsewhere (CPU, sm89, sm100 in torch 2.13) the same fp8 operands and scales go through one
``torch._scaled_mm`` per expert (:func:`per_group_mm`): the same products up to accumulation order.

What torch's grouped kernel imposes, and so every path does:

- both operands e4m3 (e4m3fnuz on gfx942): the output gradient too, whatever ``fp8_recipe.grad_dtype`` (torchao's
  MoE recipe does the same); the output in bf16, cast to the compute dtype after;
- the wgrad's groups start at multiples of 16 tokens (16-byte aligned reads along the contraction): its operands are
  copied into a zero-padded buffer, at most 16 rows more per expert (zero rows add nothing);
- current scaling only (the backends refuse delayed scaling with experts: one history per expert and group of
  tokens is not kept).

On the GPUs measured so far it is slower than bf16's grouped GEMM at the expert shapes people train (the
backward's kernels at a few hundred tokens an expert, and quantising the weights every call: the numbers are in
benchmarks/README.md), so core's ``fp8_experts`` rule keeps the experts bf16 (:data:`MEASURED_SPEEDUP`). The CPU tests check every
grouped-kernel call's operands against torch's own meta function for ``_scaled_grouped_mm`` (dtypes, layouts, scale
shapes) and the numbers through the per-expert path.

Quantization: on a GPU (``impl`` resolved to ``triton``, :func:`resolve_impl`) Triton kernels with no host sync
(:mod:`.triton_grouped`): the activations per row (:mod:`.triton_quantize`), the weight read once per amax and cast
pass into both layouts (the dgrad's kept from the forward), the wgrad operands' jagged scales and their padded,
transposed fp8 copies one kernel each, the padded group ends computed in that kernel. The PyTorch path (CPU,
torch.compile) is the reference: scatter / index ops and a host-free but multi-pass padding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from primus.turbo.availability import rocm_arch
from primus.turbo.fp8.device import compute_dtype, for_device
from primus.turbo.fp8.quantize import Impl, quantize, resolve_impl
from primus.turbo.fp8.recipe import FP8_MAX, Fp8Recipe
from primus.turbo.fp8.scaling import DTYPES, scale_from_amax, scale_inv_from_amax

ALIGN = 16  # tokens: the wgrad's group starts, 16 bytes of fp8


@functools.cache
def _grouped_kernel_runs(device_type: str, index: int | None) -> bool:
    if device_type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    if getattr(torch.version, "hip", None):
        built = any(flag in torch.__config__.show() for flag in ("USE_MSLK", "USE_FBGEMM_GENAI"))
        return built and rocm_arch().startswith(("gfx942", "gfx950"))
    return torch.cuda.get_device_capability(index)[0] == 9


# Forward + backward time of bf16's grouped GEMM over this one's, the slowest of the measured MoE expert shapes
# (Qwen3-30B-A3B at 4k / 8k tokens, Mixtral 8x7B; benchmarks/moe_kernels_h200.py, in the GPU suite), by device name.
# core's kernels.fp8_experts keeps the experts in bf16 where this is below 1 or the device is not listed.
# H100: 0.44 / 0.46 / 0.93 (Triton-fused quantisation).
MEASURED_SPEEDUP = {"H100": 0.44}


def grouped_gemm_speedup() -> float | None:
    """This device's measured speed over bf16 (:data:`MEASURED_SPEEDUP`); None where not measured."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in MEASURED_SPEEDUP.items() if k in name), None)


def grouped_kernel_runs(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs on ``device`` (torch's PLATFORM_SUPPORTS_FP8_GROUPED_GEMM)."""
    return _grouped_kernel_runs(device.type, device.index)


def per_group_mm(a, b, scale_a, scale_b, offs, *, fast_accum: bool) -> torch.Tensor:
    """``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs)`` as one ``torch._scaled_mm`` per group, for
    its two forms here: ``a`` [T, K] × ``b`` [G, K, N] (groups of a's rows; scales [T] and [G, N]) and ``a`` [N, T] ×
    ``b`` [T, K] (groups along T; scales [G·N] and [G·K]; out [G, N, K]). Output bf16; rows outside every group 0."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    mm = functools.partial(torch._scaled_mm, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[-1], dtype=torch.bfloat16, device=a.device)
        for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
            if e > s:
                out[s:e] = mm(a[s:e], b[g], scale_a[s:e].view(-1, 1), scale_b[g].view(1, -1))
        return out
    n, k = a.shape[0], b.shape[1]
    out = torch.zeros(len(ends), n, k, dtype=torch.bfloat16, device=a.device)
    for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
        if e > s:
            a_g, b_g = a[:, s:e].contiguous(), b[s:e].t().contiguous().t()
            out[g] = mm(a_g, b_g, scale_a[g * n : (g + 1) * n].view(-1, 1), scale_b[g * k : (g + 1) * k].view(1, -1))
    return out


def _gemm(a, b, scale_a, scale_b, offs, *, fast_accum: bool, grouped: bool) -> torch.Tensor:
    if grouped:
        return torch._scaled_grouped_mm(
            a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast_accum
        )
    return per_group_mm(a, b, scale_a, scale_b, offs, fast_accum=fast_accum)


def _rows(t: torch.Tensor, fmt: str, rowwise: bool, impl: Impl):
    """``t`` [rows, cols] in fp8, its per-row ``scale_inv`` [rows] (tensorwise: the one scale, repeated) and its
    amax (tensorwise: the wgrad's jagged operand takes the same scale)."""
    q = quantize(t, fmt, rowwise=rowwise, impl=impl)
    return q.data, q.scale_inv.reshape(-1).expand(t.shape[0]).contiguous(), q.amax


def _experts(w: torch.Tensor, fmt: str, rowwise: bool, impl: Impl) -> tuple[torch.Tensor, torch.Tensor]:
    """A stack of matrices ``w`` [G, R, C] in fp8, scaled along C: ``scale_inv`` [G, R], per row of each matrix, or
    (tensorwise) one per matrix, repeated."""
    g, r, c = w.shape
    if rowwise:
        data, scale_inv, _ = _rows(w.reshape(g * r, c), fmt, True, impl)
        return data.view(g, r, c), scale_inv.view(g, r)
    # one row per matrix, its own amax (PyTorch ops: a row of r·c elements is no row block for the Triton kernel)
    q = quantize(w.reshape(g, r * c), fmt, rowwise=True, impl="torch")
    return q.data.view(g, r, c), q.scale_inv.expand(g, r).contiguous()


def _jagged(t: torch.Tensor, group: torch.Tensor, groups: int, fmt: str, rowwise: bool):
    """``t`` [T, C] in fp8 scaled per (group, column) over each group's rows (``group`` [T]: each row's group, ``groups``
    for rows outside every group), or tensorwise by the whole tensor; ``scale_inv`` [groups, C]. The arithmetic of
    :func:`primus.turbo.fp8.quantize.quantize_torch`, non-finite amax included."""
    tf, cols = t.float(), t.shape[1]
    if rowwise:
        amax = tf.new_zeros(groups + 1, cols)
        amax.scatter_reduce_(0, group[:, None].expand(-1, cols), tf.abs(), "amax")
    else:
        amax = tf.abs().amax().expand(groups + 1, cols)
    fmax = FP8_MAX[fmt]
    data = (tf * scale_from_amax(amax, fmt)[group]).clamp(-fmax, fmax).to(DTYPES[fmt])
    return data, scale_inv_from_amax(amax[:groups], fmt)


def _padded_groups(offs: torch.Tensor, tokens: int):
    """Each row's group (``len(offs)`` outside every group), its row in a buffer where every group starts at a multiple
    of :data:`ALIGN`, the buffer's group ends (int32) and its length: a bound known without reading ``offs`` on the
    host (each group pads by less than ALIGN)."""
    ends = offs.long()
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_ends = torch.cumsum((sizes + ALIGN - 1) // ALIGN * ALIGN, 0)
    rows = torch.arange(tokens, device=offs.device)
    group = torch.searchsorted(ends, rows, right=True)
    # a row of group g moves by the padding of the groups before it (index len(offs): rows outside every group)
    before = torch.cat([ends.new_zeros(1), padded_ends - ends])
    dest = rows + before[group]
    length = (tokens + ALIGN - 1) // ALIGN * ALIGN + ALIGN * len(offs)
    return group, dest, padded_ends.to(torch.int32), length


def _scatter_rows(data: torch.Tensor, dest: torch.Tensor, keep: torch.Tensor, length: int) -> torch.Tensor:
    """fp8 ``data`` rows (those ``keep`` marks) at rows ``dest`` of a zero buffer of ``length`` rows. As bytes: index
    copies of fp8 dtypes are not implemented everywhere, and e4m3's zero is the zero byte. The rows not kept go to
    one spare row, dropped (a boolean mask would read its count on the host)."""
    out = torch.zeros(length + 1, data.shape[1], dtype=torch.uint8, device=data.device)
    out[torch.where(keep, dest, length)] = data.view(torch.uint8)
    return out[:length].view(data.dtype)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # no same-dtype .to(): traced under torch.compile it is a second node aliasing an intermediate (see linear._mm)
    return t if t.dtype == dtype else t.to(dtype)


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, recipe: Fp8Recipe, impl: Impl, out_dtype: torch.dtype):
        rowwise, fmt = recipe.mode == "rowwise", recipe.forward_format
        impl, grouped = resolve_impl(x, impl), grouped_kernel_runs(x.device)
        xq, xs, x_amax = _rows(x, fmt, rowwise, impl)
        wt = (None, None)
        if impl == "triton":  # both weight layouts from one read; the dgrad's kept for the backward (1 byte / weight)
            from primus.turbo.fp8 import triton_grouped

            wq, ws, *wt = triton_grouped.quantize_experts(w, fmt, rowwise)
        else:
            wq, ws = _experts(w, fmt, rowwise, impl)  # [G, N, K], scales [G, N]
        y = _gemm(xq, wq.transpose(-2, -1), xs, ws, offs, fast_accum=True, grouped=grouped)
        ctx.save_for_backward(x, w, offs, None if rowwise else x_amax, *wt)
        ctx.recipe, ctx.impl, ctx.grouped = recipe, impl, grouped
        return _as(y, out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs, x_amax, wtq, wts = ctx.saved_tensors
        recipe, impl, grouped = ctx.recipe, ctx.impl, ctx.grouped
        rowwise, fmt, fast = recipe.mode == "rowwise", recipe.forward_format, recipe.fast_accum_backward
        gemm = functools.partial(_gemm, fast_accum=fast, grouped=grouped)
        dy = dy.contiguous()
        # dgrad: dy [T, N] · W_g [N, K], W_g scaled along N (per input column)
        dyq, dys, dy_amax = _rows(dy, fmt, rowwise, impl)
        if wtq is None:
            wtq, wts = _experts(w.transpose(-2, -1).contiguous(), fmt, rowwise, impl)  # [G, K, N], scales [G, K]
        dx = _as(gemm(dyq, wtq.transpose(-2, -1), dys, wts, offs), x.dtype)
        # wgrad: dy_gᵀ [N, T_g] · x_g [T_g, K] per expert, groups along the padded token dim
        if impl == "triton":  # jagged scales and padded, transposed fp8 copies in one kernel each, offsets on device
            from primus.turbo.fp8 import triton_grouped

            given = (None, None) if rowwise else (dy_amax, x_amax)
            a, dygs, padded_offs = triton_grouped.jagged_padded_t(dy, offs, fmt, amax=given[0], ends=True)
            bt, xgs, _ = triton_grouped.jagged_padded_t(x, offs, fmt, amax=given[1])
            dw = _as(gemm(a, bt.t(), dygs, xgs, padded_offs), w.dtype)
            return dx, dw, None, None, None, None
        groups = w.shape[0]
        group, dest, padded_offs, length = _padded_groups(offs, x.shape[0])
        keep = group < groups
        dyg, dygs = _jagged(dy, group, groups, fmt, rowwise)
        xg, xgs = _jagged(x, group, groups, fmt, rowwise)
        a = _scatter_rows(dyg, dest, keep, length).t().contiguous()  # [N, L] row-major
        b = _scatter_rows(xg, dest, keep, length).t().contiguous().t()  # [L, K] column-major
        dw = _as(gemm(a, b, dygs.reshape(-1), xgs.reshape(-1), padded_offs), w.dtype)
        return dx, dw, None, None, None, None


def fp8_grouped_gemm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, recipe: Fp8Recipe, impl: Impl = "auto"
) -> torch.Tensor:
    """The ``grouped_gemm`` contract in FP8 under ``recipe`` (as :func:`for_device` made it): y in the dtype a bf16 /
    fp32 grouped GEMM would give (autocast's when on), x's and w's gradients in their own dtypes."""
    if recipe.scaling == "delayed":
        raise ValueError("fp8 grouped GEMM: current scaling only (delayed histories would be per expert and group)")
    out_dtype = compute_dtype(x)
    if offs.dtype != torch.int32:
        offs = offs.to(torch.int32)
    with torch.autocast(x.device.type, enabled=False):
        return _Fp8GroupedMM.apply(x.to(out_dtype), w, offs, recipe, impl, out_dtype)


def grouped_gemm_for(recipe: Fp8Recipe) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The ``grouped_gemm(x, w, offs)`` callable of this FP8 provider under ``recipe`` (this device's formats)."""
    return functools.partial(fp8_grouped_gemm, recipe=for_device(recipe))
