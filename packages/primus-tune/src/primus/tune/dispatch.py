"""Linears that run each of their three GEMMs through the tuned algorithm where it won, else through torch.

``tuned_linear(x, weight, bias, plans)`` computes ``x @ weight.T + bias`` like ``F.linear``; forward (``NT``),
input gradient (``g @ W``, ``NN``) and weight gradient (``g.T @ x``, ``TN``) each look up their own
:class:`GemmShape` in ``plans`` (a :class:`PlanProvider`): a hit runs the tuned GEMM, a miss ``torch.mm``. The
bias is added by torch (its gradient is a sum), so a tuned GEMM never needs a bias epilogue.

:class:`NvmathPlans` is the CUDA provider: one planned nvmath ``Matmul`` per tuned shape, built on first use from
the algorithm in the results file, then launched through nvmath's cuBLASLt binding (:class:`DirectLaunch`).
:func:`patch_linears` routes a model's ``nn.Linear`` modules here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from primus.tune.record import dtype_name, layout_of
from primus.tune.shapes import GemmShape

log = logging.getLogger("primus.tune")

Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PlanProvider(Protocol):
    def lookup(self, shape: GemmShape) -> Gemm | None:
        """The tuned GEMM for ``shape`` (called with ``a``, ``b`` laid out as the shape says), or None."""


def shape_of(a: torch.Tensor, b: torch.Tensor) -> GemmShape:
    return GemmShape(
        "mm",
        m=a.shape[0],
        n=b.shape[1],
        k=a.shape[1],
        layout=layout_of(a) + layout_of(b),
        dtype=dtype_name(a.dtype),
        out_dtype=dtype_name(a.dtype),
    )


def _dense(t: torch.Tensor) -> bool:
    """Row-major or transposed-row-major with no padding: the strides a tuned plan was made for."""
    r, c = t.shape
    return t.stride() in ((c, 1), (1, r)) and t.data_ptr() % 16 == 0


def gemm(a: torch.Tensor, b: torch.Tensor, plans: PlanProvider | None) -> torch.Tensor:
    """``a @ b`` through the tuned plan for this shape and layout when there is one."""
    if plans is not None and a.dtype == b.dtype and _dense(a) and _dense(b):
        fn = plans.lookup_operands(a, b) if isinstance(plans, StaticPlans) else plans.lookup(shape_of(a, b))
        if fn is not None:
            return fn(a, b)
    return torch.mm(a, b)


class _TunedLinear(torch.autograd.Function):
    """On 2-D ``x`` (tokens × in): the caller reshapes outside, so the output is no view made inside the Function
    (a view of it modified in place, as megatron's vocab-parallel cross-entropy does to the logits, would be an
    autograd error)."""

    @staticmethod
    def forward(ctx, x2, weight, bias, plans):
        out = gemm(x2, weight.t(), plans)
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x2, weight)
        ctx.plans, ctx.has_bias = plans, bias is not None
        return out

    @staticmethod
    def backward(ctx, g2):
        x2, weight = ctx.saved_tensors
        if not g2.is_contiguous():
            g2 = g2.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = gemm(g2, weight, ctx.plans)
        if ctx.needs_input_grad[1]:
            dw = gemm(g2.t(), x2, ctx.plans)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.sum(0)
        return dx, dw, db, None


def tuned_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, plans: PlanProvider | None = None
) -> torch.Tensor:
    """``F.linear`` whose three GEMMs use tuned plans where they won. Under autocast the operands are cast first
    (as autocast does for ``F.linear``). Anything unusual (no plans, a DTensor or sparse weight, mismatched dtypes)
    goes to ``F.linear`` unchanged."""
    if plans is None or type(weight) not in (torch.Tensor, nn.Parameter) or x.dim() < 2:
        return F.linear(x, weight, bias)
    if torch.is_autocast_enabled(x.device.type):  # cast as autocast would for F.linear, so the GEMMs match
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return _TunedLinear.apply(x2, weight, bias, plans).view(*x.shape[:-1], weight.shape[0])


MEGATRON_LINEARS = ("ColumnParallelLinear", "RowParallelLinear")


def _megatron_linear(mod: nn.Module) -> bool:
    """megatron-core's own tensor-parallel linears (not subclasses: e.g. FP8 linears keep their GEMM)."""
    return type(mod).__name__ in MEGATRON_LINEARS and type(mod).__module__.startswith("megatron.core")


def _tuned_forward_impl(original: Callable, plans: PlanProvider) -> Callable:
    """megatron's ``_forward_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
    sequence_parallel, ...)`` is a plain linear when none of those three is on (tp 1, no fused wgrad): then the
    tuned GEMMs run it; otherwise megatron's own function (its backward overlaps TP communication)."""

    def forward_impl(
        input,
        weight,
        bias=None,
        gradient_accumulation_fusion=False,
        allreduce_dgrad=False,
        sequence_parallel=False,
        **kwargs,
    ):
        if gradient_accumulation_fusion or allreduce_dgrad or sequence_parallel or not weight.requires_grad:
            return original(
                input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, **kwargs
            )
        return tuned_linear(input, weight, bias, plans)

    return forward_impl


def patch_linears(model: nn.Module, plans: PlanProvider) -> int:
    """Route every ``nn.Linear`` of ``model``, and megatron-core's parallel linears, through :func:`tuned_linear`;
    returns how many were patched."""
    count = 0
    for mod in model.modules():
        if type(mod) is nn.Linear:

            def forward(x, mod=mod):
                return tuned_linear(x, mod.weight, mod.bias, plans)

            mod.forward = forward
            count += 1
        elif _megatron_linear(mod):
            mod._forward_impl = _tuned_forward_impl(mod._forward_impl, plans)
            count += 1
    return count


class StaticPlans:
    """A provider from a dict ``{GemmShape.key: gemm}`` (tests, and what the providers below cache)."""

    def __init__(self, table: dict[str, Gemm] | None = None) -> None:
        self.table = dict(table or {})
        self.hits: dict[str, int] = {}
        self.misses: dict[str, GemmShape] = {}
        self._memo: dict[tuple, GemmShape] = {}

    def lookup(self, shape: GemmShape) -> Gemm | None:
        fn = self.table.get(shape.key)
        if fn is None:
            self.misses.setdefault(shape.key, shape)
            return None
        self.hits[shape.key] = self.hits.get(shape.key, 0) + 1
        return fn

    def lookup_operands(self, a: torch.Tensor, b: torch.Tensor) -> Gemm | None:
        """``lookup(shape_of(a, b))`` with one shape object (and so one key string) per operand layout: this runs
        for every GEMM of every patched linear, and building both each time was host time a training step felt."""
        memo = (a.shape, b.shape, a.stride(), b.stride(), a.dtype)
        shape = self._memo.get(memo)
        if shape is None:
            shape = self._memo[memo] = shape_of(a, b)
        return self.lookup(shape)


class DirectLaunch:
    """A planned nvmath ``Matmul`` launched through nvmath's cuBLASLt binding (``cublasLt.matmul``) with new
    operands: the same handle, descriptors, layouts and algorithm ``Matmul.execute`` uses, without its per-call
    bookkeeping (operand wrapping, logging, events), which costs ~150 us of host time a call against torch.mm's
    ~30 us (benchmarks/results/nvmath_dispatch_cost.json) and ate half of what the tuned GEMMs saved in training.

    Written against nvmath-python 1.0's ``Matmul`` attributes (``handle``, ``mm_desc``, ``*_layout_ptr``, ``alpha``,
    ``beta``, ``algorithms_buffer``, ``result_traits``); :meth:`of` returns None where they are missing, and the
    caller keeps ``Matmul.execute``. Operands must be aligned as the algorithm was searched (256 bytes, cuBLASLt's
    default): :meth:`__call__` returns None otherwise and the caller runs torch."""

    ALIGN = 256
    ATTRS = ("handle", "mm_desc", "a_layout_ptr", "b_layout_ptr", "c_layout_ptr", "d_layout_ptr", "alpha", "beta")

    def __init__(self, mm: Any) -> None:
        from nvmath.bindings import cublasLt

        self._mm = mm  # owns the handle, descriptors and the buffers whose addresses are kept below
        self._matmul = cublasLt.matmul
        self._algo = mm.algorithms_buffer[0]["algo"]
        self._handle, self._desc = mm.handle, mm.mm_desc
        self._alpha, self._beta, self._algo_ptr = mm.alpha.ctypes.data, mm.beta.ctypes.data, self._algo.ctypes.data
        self._layouts = (mm.a_layout_ptr, mm.b_layout_ptr, mm.c_layout_ptr, mm.d_layout_ptr)
        self._ws_size = int(mm.algorithms_buffer["workspace_size"].max())
        self._shape = tuple(mm.result_traits.result_shape)
        self._strides = tuple(mm.result_traits.result_strides)

    @classmethod
    def of(cls, mm: Any) -> DirectLaunch | None:
        if not all(getattr(mm, a, None) is not None for a in cls.ATTRS) or mm.algorithms_buffer is None:
            return None
        try:
            return cls(mm)
        except (ImportError, AttributeError, KeyError, ValueError) as exc:
            log.info("tuned GEMMs dispatch through Matmul.execute (%s: %s)", type(exc).__name__, exc)
            return None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        if x.data_ptr() % self.ALIGN or y.data_ptr() % self.ALIGN:
            return None
        out = torch.empty_strided(self._shape, self._strides, dtype=x.dtype, device=x.device)
        # a workspace per call from torch's caching allocator: stream-ordered like the GEMM that uses it
        ws = torch.empty(max(self._ws_size, 1), dtype=torch.uint8, device=x.device)
        a_layout, b_layout, c_layout, d_layout = self._layouts
        self._matmul(
            self._handle, self._desc, self._alpha, x.data_ptr(), a_layout, y.data_ptr(), b_layout, self._beta,
            0, c_layout, out.data_ptr(), d_layout, self._algo_ptr, ws.data_ptr(), self._ws_size,  # no C: beta is 0
            torch.cuda.current_stream(x.device).cuda_stream,
        )  # fmt: skip
        return out


class NvmathPlans(StaticPlans):
    """CUDA: the tuned cuBLASLt algorithms of a results file, each planned once (nvmath ``Matmul``) on its first
    use and then launched directly (:class:`DirectLaunch`) with new operands. Shapes whose default won are not in
    the table: torch runs them. ``unaligned`` counts calls that went to torch because an operand was not aligned
    as the algorithm needs."""

    def __init__(self, entries: dict[str, Any]) -> None:
        super().__init__()
        self.entries = dict(entries)  # key -> TuningEntry whose winner is "tuned"
        self._matmuls: dict[str, Any] = {}
        self._launch: dict[str, DirectLaunch | None] = {}
        self.unaligned = 0

    def add(self, entry: Any) -> None:
        self.entries[entry.shape.key] = entry
        self.table.pop(entry.shape.key, None)

    def lookup(self, shape: GemmShape) -> Gemm | None:
        key = shape.key
        if key not in self.table and key in self.entries:
            self.table[key] = self._gemm(key)
        return super().lookup(shape)

    def _gemm(self, key: str) -> Gemm:
        from primus.tune.searchers import decode_algorithm, lt_operands

        algorithm = decode_algorithm(self.entries[key].solution["algorithm"])

        def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            x, y, flip = lt_operands(a, b)  # a row-major result, as torch.mm gives
            launch = self._launch.get(key)
            if launch is not None:
                out = launch(x, y)
                if out is None:
                    self.unaligned += 1
                    return torch.mm(a, b)
                return out.t() if flip else out
            stream = torch.cuda.current_stream()
            mm = self._matmuls.get(key)
            if mm is None:
                from nvmath.linalg.advanced import Matmul

                mm = Matmul(x, y, stream=stream)
                mm.plan(algorithms=[algorithm], stream=stream)
                self._matmuls[key] = mm
                self._launch[key] = DirectLaunch.of(mm)
            else:
                mm.reset_operands(a=x, b=y, stream=stream)
            out = mm.execute(stream=stream)
            mm.release_operands()  # do not keep activations alive between steps
            return out.t() if flip else out

        return run

    def free(self) -> None:
        self._launch.clear()
        for mm in self._matmuls.values():
            mm.free()
        self._matmuls.clear()
