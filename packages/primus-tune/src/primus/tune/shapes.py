"""One GEMM as BLAS sees it: sizes, operand layouts, dtypes, bias. No torch import (the CLI lists shape files).

Sizes and layouts are in PyTorch's row-major terms: ``out[m, n] = a[m, k] @ b[k, n]`` (per batch), and an
operand's layout is ``N`` when it is row-major in memory (last stride 1) and ``T`` when it is a transposed view
of a row-major matrix (first stride 1). ``x @ W.T`` (a linear's forward) is ``NT``; its input gradient
``g @ W`` is ``NN``; its weight gradient ``g.T @ x`` is ``TN``. :meth:`GemmShape.blas` gives the column-major
view the BLAS library gets (torch swaps the operands: ``out.T = b.T @ a.T``), which is how TunableOp and
hipBLASLt logs name the same GEMM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any

GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "scaled_mm")


@dataclass(frozen=True, order=True)
class GemmShape:
    op: str  # one of GEMM_OPS
    m: int
    n: int
    k: int
    batch: int = 1
    layout: str = "NN"  # layout of a, then b (row-major terms)
    dtype: str = "bfloat16"  # of a (and b, unless b_dtype says otherwise)
    out_dtype: str = "bfloat16"
    bias: bool = False
    b_dtype: str | None = None  # only when it differs from a's (fp8 e4m3 x e5m2)

    @cached_property  # made once per shape object: the tuned dispatch looks shapes up on every GEMM
    def key(self) -> str:
        """A stable string id: ``mm NT bfloat16 m8192 n2048 k2048`` (+ batch, bias, dtypes when they matter)."""
        parts = [self.op, self.layout, self.dtype]
        if self.b_dtype:
            parts.append(f"b:{self.b_dtype}")
        if self.out_dtype != self.dtype:
            parts.append(f"out:{self.out_dtype}")
        parts += [f"m{self.m}", f"n{self.n}", f"k{self.k}"]
        if self.batch != 1:
            parts.append(f"batch{self.batch}")
        if self.bias:
            parts.append("bias")
        return " ".join(parts)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch

    def blas(self) -> dict[str, Any]:
        """The column-major problem the BLAS library is asked (torch computes ``out.T = b.T @ a.T``)."""
        return {
            "transa": self.layout[1],
            "transb": self.layout[0],
            "m": self.n,
            "n": self.m,
            "k": self.k,
            "batch": self.batch,
        }

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GemmShape:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def linear_gemms(tokens: int, in_features: int, out_features: int, dtype: str = "bfloat16") -> list[GemmShape]:
    """The three GEMMs of ``y = x @ W.T`` with ``x [tokens, in]``, ``W [out, in]``: forward, input gradient,
    weight gradient, as PyTorch's autograd issues them (the weight gradient is computed as ``g.T @ x``)."""
    return [
        GemmShape("mm", m=tokens, n=out_features, k=in_features, layout="NT", dtype=dtype, out_dtype=dtype),
        GemmShape("mm", m=tokens, n=in_features, k=out_features, layout="NN", dtype=dtype, out_dtype=dtype),
        GemmShape("mm", m=out_features, n=in_features, k=tokens, layout="TN", dtype=dtype, out_dtype=dtype),
    ]


def parse_shape(text: str, dtype: str = "bfloat16", layout: str = "NN") -> GemmShape:
    """``"m,n,k"`` (or ``"m,n,k,LAYOUT"``) from the command line."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts[:3]):
        raise ValueError(f"a shape is m,n,k or m,n,k,LAYOUT (layout NN/NT/TN/TT), got {text!r}")
    if len(parts) == 4:
        layout = parts[3].upper()
    if layout not in ("NN", "NT", "TN", "TT"):
        raise ValueError(f"layout must be NN, NT, TN or TT, got {layout!r}")
    m, n, k = (int(p) for p in parts[:3])
    return GemmShape("mm", m=m, n=n, k=k, layout=layout, dtype=dtype, out_dtype=dtype)
