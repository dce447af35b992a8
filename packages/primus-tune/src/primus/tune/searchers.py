"""GEMM searchers behind one interface: give them shapes and a budget, get one :class:`TuningEntry` per shape with
default and tuned TF/s, the solution, and the winner (the tuned solution only where it is faster).

- ROCm: :class:`TunableOpSearcher`, PyTorch TunableOp (hipBLASLt and rocBLAS solutions, the default among them).
- CUDA: :class:`CublasLtSearcher`, cuBLASLt algorithms through nvmath-python. TunableOp on CUDA (torch
  2.10-2.13) registers only the cuBLAS default, so it tunes nothing there.
- CPU: none; :func:`select_searcher` says so.

The hipblaslt-bench offline path is in :mod:`primus.tune.hipblaslt`.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

from primus.core.contracts.errors import UserError
from primus.tune.results import TuningEntry, pick_winner
from primus.tune.shapes import GemmShape

log = logging.getLogger("primus.tune")

TUNABLE_DTYPES = ("bfloat16", "float16", "float32")
BUDGET_SPENT = "search time budget spent"


class NoSearcher(UserError, RuntimeError):
    """No GEMM searcher can run here (CPU, or a missing library); the message says what to do."""


@dataclass(frozen=True)
class SearchBudget:
    """How much searching: ``limit`` candidate algorithms per shape (cuBLASLt heuristics), ``iterations`` of
    autotuning (cuBLASLt) or TunableOp tuning iterations, ``repeats`` interleaved rounds of the default-vs-tuned
    comparison, ``min_gain`` the fraction the tuned one must win by, ``max_seconds`` the wall-clock cap over all
    shapes (None: no cap; shapes left over keep the default)."""

    limit: int = 16
    iterations: int = 20
    repeats: int = 15
    inner: int = 5
    min_gain: float = 0.01
    max_seconds: float | None = None


class Searcher(Protocol):
    name: str

    def unsupported(self, shape: GemmShape) -> str | None:
        """Why this searcher cannot tune ``shape``, or None."""

    def tune(self, shapes: list[GemmShape], budget: SearchBudget) -> list[TuningEntry]: ...


def select_searcher(platform: str) -> Searcher:
    """The searcher for ``"cuda"``, ``"rocm"`` or ``"cpu"`` (:func:`primus.core.kernels.selection.detect_device`)."""
    if platform == "rocm":
        return TunableOpSearcher()
    if platform == "cuda":
        return CublasLtSearcher()
    raise NoSearcher(
        "GEMM tuning needs a GPU: on ROCm it uses PyTorch TunableOp, on CUDA cuBLASLt through nvmath-python; "
        f"this machine is {platform}. Set kernels.gemm_tuning=off, or record shapes here "
        "(primus tune gemm record) and tune them on the GPU (primus tune gemm run)."
    )


def _plain_gemm(shape: GemmShape) -> str | None:
    if shape.op != "mm" or shape.batch != 1:
        return f"{shape.op} (batch {shape.batch}) is not searched; only plain 2-D mm"
    if shape.layout == "TT":
        return "layout TT is not searched (linears issue NT, NN and TN)"
    if shape.dtype not in TUNABLE_DTYPES or shape.out_dtype != shape.dtype or shape.b_dtype:
        return f"dtype {shape.dtype}->{shape.out_dtype} is not searched"
    return None


def _over_budget(start: float, budget: SearchBudget) -> bool:
    return budget.max_seconds is not None and time.perf_counter() - start > budget.max_seconds


# ------------------------------------------------------------------------------------------- cuBLASLt (CUDA)


def lt_operands(a: Any, b: Any) -> tuple[Any, Any, bool]:
    """Operands for nvmath such that the result is row-major like torch's: nvmath orders the result like ``a``,
    so for a transposed ``a`` it computes ``(b.T @ a.T).T`` (the same column-major problem cuBLASLt sees)."""
    if a.stride(0) == 1 and a.stride(1) != 1:
        return b.t(), a.t(), True
    return a, b, False


def encode_algorithm(algorithm: Any) -> str:
    """An nvmath ``Algorithm`` as base64 of its cuBLASLt heuristic-result bytes (``Algorithm.as_numpy``)."""
    return base64.b64encode(algorithm.as_numpy().tobytes()).decode()


def decode_algorithm(text: str) -> Any:
    import numpy as np
    from nvmath.bindings.cublasLt import matmul_heuristic_result_dtype
    from nvmath.linalg.advanced import Algorithm

    return Algorithm.from_numpy(np.frombuffer(base64.b64decode(text), dtype=matmul_heuristic_result_dtype))


class CublasLtSearcher:
    """cuBLASLt algorithm search through nvmath-python: plan ``limit`` heuristic candidates, autotune them, then
    measure the best against torch's own GEMM (the default) interleaved; keep the faster."""

    name = "cublaslt"

    def __init__(self, device: str = "cuda") -> None:
        try:
            import nvmath.linalg.advanced  # noqa: F401
        except ImportError as exc:
            raise NoSearcher(
                f"GEMM tuning on CUDA searches cuBLASLt algorithms through nvmath-python, which is not installed "
                f"({exc}); pip install 'primus-tune[cuda]' (nvmath-python)"
            ) from None
        self.device = device

    def unsupported(self, shape: GemmShape) -> str | None:
        return _plain_gemm(shape)

    def tune(self, shapes: list[GemmShape], budget: SearchBudget) -> list[TuningEntry]:
        start = time.perf_counter()
        entries = []
        for shape in shapes:
            if _over_budget(start, budget):  # not measured at all: online mode retries it after the next step
                entries.append(TuningEntry(shape, 0.0, searcher=self.name, note=BUDGET_SPENT))
                continue
            why = self.unsupported(shape)
            try:
                entries.append(self._default_only(shape, budget, why) if why else self.tune_one(shape, budget))
            except Exception as exc:  # one failing shape keeps the default; the others still tune
                log.warning("GEMM %s: search failed (%s: %s); keeping the default", shape.key, type(exc).__name__, exc)
                entries.append(TuningEntry(shape, 0.0, searcher=self.name, note=f"failed: {exc}"))
        return entries

    def _default_only(self, shape: GemmShape, budget: SearchBudget, why: str) -> TuningEntry:
        import torch

        from primus.tune.bench import interleaved_medians, operands, tflops

        default = 0.0
        if shape.op == "mm" and shape.dtype in TUNABLE_DTYPES:
            a, b = operands(shape, self.device)
            ms = interleaved_medians({"default": lambda: torch.mm(a, b)}, device=self.device, repeats=budget.repeats)
            default = tflops(shape, ms["default"])
        return TuningEntry(shape, default, searcher=self.name, note=why)

    def tune_one(self, shape: GemmShape, budget: SearchBudget) -> TuningEntry:
        import torch
        from nvmath.linalg.advanced import Matmul, MatmulPlanPreferences

        from primus.tune.bench import interleaved_medians, operands, tflops

        a, b = operands(shape, self.device)
        x, y, flip = lt_operands(a, b)
        stream = torch.cuda.current_stream()
        with Matmul(x, y, stream=stream) as mm:
            planned = list(mm.plan(preferences=MatmulPlanPreferences(limit=budget.limit), stream=stream))
            mm.autotune(iterations=budget.iterations, stream=stream)
            best = mm.algorithms[0]
            expected = torch.mm(a, b)
            got = mm.execute(algorithm=best, stream=stream)
            got = got.t() if flip else got
            err = ((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-6)).item()
            if err > 2e-2:
                raise RuntimeError(f"tuned algorithm disagrees with torch.mm (relative error {err:.3g})")

            def tuned():
                out = mm.execute(algorithm=best, stream=stream)
                return out.t() if flip else out

            ms = interleaved_medians(
                {"default": lambda: torch.mm(a, b), "tuned": tuned},
                device=self.device,
                repeats=budget.repeats,
                inner=budget.inner,
            )
        default_tf, tuned_tf = tflops(shape, ms["default"]), tflops(shape, ms["tuned"])
        index = next((i for i, alg in enumerate(planned) if alg is best), None)
        solution = {
            "algorithm": encode_algorithm(best),
            "algorithm_id": int(best.algorithm_id),
            "heuristic_index": index,
            "candidates": len(planned),
        }
        winner = pick_winner(default_tf, tuned_tf, budget.min_gain)
        return TuningEntry(shape, default_tf, tuned_tf, solution, winner, self.name)


# ------------------------------------------------------------------------------------------- TunableOp (ROCm)


class TunableOpSearcher:
    """PyTorch TunableOp (``torch.cuda.tunable``): each shape's GEMM is run once with tuning on, which searches
    the hipBLASLt and rocBLAS solutions (the default among them) and records the fastest. Then default (TunableOp
    off) and tuned (TunableOp on, tuning off) are measured interleaved.

    Version differences: ``write_file`` exists before torch 2.10 and must be
    called to save results; from 2.10 results are appended to the file as they are found."""

    name = "tunableop"

    def __init__(self, tunable: Any = None, device: str = "cuda") -> None:
        if tunable is None:
            import torch.cuda.tunable as tunable
        missing = [
            f
            for f in ("enable", "tuning_enable", "set_max_tuning_iterations", "get_results")
            if not hasattr(tunable, f)
        ]
        if missing:
            raise NoSearcher(f"torch.cuda.tunable lacks {', '.join(missing)}: TunableOp needs torch >= 2.5")
        self.t = tunable
        self.device = device

    @property
    def writes_in_real_time(self) -> bool:
        return not hasattr(self.t, "write_file")

    def unsupported(self, shape: GemmShape) -> str | None:
        return _plain_gemm(shape)

    def _configure(self, filename: str | None, max_iterations: int) -> None:
        if filename:  # one file per GPU when several ranks tune (TunableOp inserts the device ordinal)
            self.t.set_filename(filename, int(os.environ.get("WORLD_SIZE", "1")) > 1)
        self.t.set_max_tuning_iterations(max_iterations)
        self.t.enable(True)

    def start(self, filename: str | None, max_iterations: int) -> None:
        """Tuning on: every new GEMM shape is searched on first use (online mode calls this at train start)."""
        self._configure(filename, max_iterations)
        self.t.tuning_enable(True)

    def stop(self) -> None:
        """Tuning off, tuned solutions stay in use; results saved (torch < 2.10 needs ``write_file``)."""
        self.t.tuning_enable(False)
        if not self.writes_in_real_time:
            self.t.write_file()

    def results(self) -> list[tuple[str, str, str, float]]:
        """TunableOp's ``(op signature, params signature, solution, ms)`` rows found so far."""
        return [(str(r[0]), str(r[1]), str(r[2]), float(r[3])) for r in self.t.get_results()]

    def tune(self, shapes: list[GemmShape], budget: SearchBudget, filename: str | None = None) -> list[TuningEntry]:
        import torch

        from primus.tune.bench import interleaved_medians, operands, tflops

        start = time.perf_counter()
        entries = []
        self._configure(filename, budget.iterations)
        try:
            for shape in shapes:
                why = self.unsupported(shape) or (BUDGET_SPENT if _over_budget(start, budget) else None)
                if why:
                    entries.append(TuningEntry(shape, 0.0, searcher=self.name, note=why))
                    continue
                a, b = operands(shape, self.device)
                before = set(self.results())
                self.t.tuning_enable(True)
                torch.mm(a, b)  # tuned on first use
                self.t.tuning_enable(False)
                new = [r for r in self.results() if r not in before]
                # already tuned (a results file read earlier): TunableOp's existing row for this shape
                known = [r for r in self.results() if shape_from_tunableop(r[0], r[1]) == shape]
                row = new[0] if new else (known[0] if known else None)

                def default(a=a, b=b):
                    self.t.enable(False)
                    return torch.mm(a, b)

                def tuned(a=a, b=b):
                    self.t.enable(True)
                    return torch.mm(a, b)

                ms = interleaved_medians(
                    {"default": default, "tuned": tuned}, device=self.device, repeats=budget.repeats, inner=budget.inner
                )
                self.t.enable(True)
                d, t = tflops(shape, ms["default"]), tflops(shape, ms["tuned"])
                winner = "default" if row is None or row[2] == "Default" else pick_winner(d, t, budget.min_gain)
                solution = None
                if row is not None:
                    solution = {"op": row[0], "params": row[1], "solution": row[2], "ms": row[3]}
                note = "" if row else "TunableOp recorded no new result for this shape"
                entries.append(TuningEntry(shape, d, t, solution, winner, self.name, note))
        finally:
            self.stop()
        return entries

    def validators(self) -> list[tuple[str, str]]:
        return [(str(k), str(v)) for k, v in self.t.get_validators()]


def shape_from_tunableop(op: str, params: str) -> GemmShape | None:
    """``GemmTunableOp_BFloat16_TN`` + ``tn_4096_8192_2048_ld_...``: the BLAS (column-major) problem back in torch's
    row-major terms (see :meth:`GemmShape.blas`). Other TunableOp ops are listed without a shape."""
    parts = op.split("_")
    dims = params.split("_")
    if not op.startswith("GemmTunableOp_") or len(parts) < 3 or len(dims) < 4:
        return None
    dtypes = {"BFloat16": "bfloat16", "Half": "float16", "float": "float32"}
    dtype = dtypes.get(parts[1])
    try:
        m_blas, n_blas, k = int(dims[1]), int(dims[2]), int(dims[3])
    except ValueError:
        return None
    if dtype is None:
        return None
    transa, transb = parts[2][0].upper(), parts[2][1].upper()
    return GemmShape("mm", m=n_blas, n=m_blas, k=k, layout=transb + transa, dtype=dtype, out_dtype=dtype)


def tunableop_csv(entries: list[TuningEntry], validators: list[tuple[str, str]]) -> str:
    """A TunableOp results file (``Validator,KEY,VAL`` lines, then ``op,params,solution,ms``) holding the solutions
    that won; the runtime loads it with ``read_file`` and tuning off (offline mode on ROCm)."""
    lines = [f"Validator,{k},{v}" for k, v in validators]
    for e in entries:
        if e.winner == "tuned" and isinstance(e.solution, dict) and "op" in e.solution:
            s = e.solution
            lines.append(f"{s['op']},{s['params']},{s['solution']},{s['ms']}")
    return "\n".join(lines) + "\n"
