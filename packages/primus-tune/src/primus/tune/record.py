"""Record the GEMMs a model step runs, below autograd: every ``mm``/``addmm``/``bmm``/``baddbmm``/``_scaled_mm``
the forward and the backward issue (``F.linear`` reaches the dispatcher as ``mm``/``addmm``), with sizes, layouts
(from strides), dtypes and bias, deduplicated with counts.

    with GemmRecorder() as rec:
        loss = model(x).sum(); loss.backward()
    rec.records  # [GemmRecord(shape, count, phases)]

Works on any device, ``meta`` included (shapes and strides without compute), and with any model: the recorder
is a ``TorchDispatchMode``, so it sees what the engine's own model issues.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from primus.tune.shapes import GemmShape

aten = torch.ops.aten

SHAPES_FORMAT = "primus-gemm-shapes/1"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(t: torch.Tensor) -> str:
    """``N`` for a row-major matrix (last stride 1), ``T`` for a transposed view (second-to-last stride 1).
    Anything else is copied to row-major by torch before BLAS sees it, so it is ``N`` too."""
    if t.dim() < 2 or t.stride(-1) == 1 or t.size(-1) == 1:
        return "N"
    return "T" if t.stride(-2) == 1 else "N"


@dataclass
class GemmRecord:
    shape: GemmShape
    count: int = 0
    phases: set[str] = field(default_factory=set)  # "forward" / "backward"

    def to_dict(self) -> dict[str, Any]:
        return {**self.shape.to_dict(), "count": self.count, "phases": sorted(self.phases)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GemmRecord:
        return cls(GemmShape.from_dict(data), int(data.get("count", 1)), set(data.get("phases", [])))


def _shape(op: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: bool) -> GemmShape:
    batch = a.shape[0] if a.dim() == 3 else 1
    return GemmShape(
        op=op,
        m=a.shape[-2],
        n=b.shape[-1],
        k=a.shape[-1],
        batch=batch,
        layout=layout_of(a) + layout_of(b),
        dtype=dtype_name(a.dtype),
        out_dtype=dtype_name(out.dtype),
        bias=bias,
        b_dtype=dtype_name(b.dtype) if b.dtype != a.dtype else None,
    )


def gemm_of(func: Any, args: tuple, kwargs: dict, out: Any) -> GemmShape | None:
    """The GEMM an aten call runs, or None when it is not one."""
    packet = getattr(func, "overloadpacket", None)
    if packet is aten.mm:
        return _shape("mm", args[0], args[1], out, bias=False)
    if packet in (aten.addmm, aten._addmm_activation):
        return _shape("addmm", args[1], args[2], out, bias=True)
    if packet is aten.bmm:
        return _shape("bmm", args[0], args[1], out, bias=False)
    if packet is aten.baddbmm:
        return _shape("baddbmm", args[1], args[2], out, bias=True)
    if packet is aten._scaled_mm:
        bias = len(args) > 4 and args[4] is not None or kwargs.get("bias") is not None
        return _shape("scaled_mm", args[0], args[1], out, bias=bias)
    if packet is aten.linear:  # only seen when a mode runs above the linear decomposition
        x, w = args[0], args[1]
        has_bias = len(args) > 2 and args[2] is not None
        x2 = x.reshape(-1, x.shape[-1])
        return _shape("addmm" if has_bias else "mm", x2, w.t(), out.reshape(-1, out.shape[-1]), bias=has_bias)
    return None


class GemmRecorder(TorchDispatchMode):
    """Records every GEMM that runs while it is active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._records: dict[GemmShape, GemmRecord] = {}
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._paused:
            shape = gemm_of(func, args, kwargs, out)
            if shape is not None:
                rec = self._records.setdefault(shape, GemmRecord(shape))
                rec.count += 1
                rec.phases.add("backward" if torch._C._current_graph_task_id() != -1 else "forward")
        return out

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not recorded inside (e.g. attention, which runs in its own kernel on GPUs, not in BLAS)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def records(self) -> list[GemmRecord]:
        return sorted(self._records.values(), key=lambda r: r.shape)

    def shapes(self) -> list[GemmShape]:
        return [r.shape for r in self.records]


def save_shapes(path: str | Path, records: list[GemmRecord], source: dict[str, Any]) -> Path:
    """Write a shapes file: ``{"format", "source": {...}, "gemms": [{shape..., count, phases}]}``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": SHAPES_FORMAT, "source": source, "gemms": [r.to_dict() for r in records]}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def load_shapes(path: str | Path) -> tuple[list[GemmRecord], dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    if data.get("format") != SHAPES_FORMAT:
        raise ValueError(f"{path}: not a GEMM shapes file (format {data.get('format')!r}, want {SHAPES_FORMAT!r})")
    return [GemmRecord.from_dict(g) for g in data["gemms"]], data.get("source", {})
