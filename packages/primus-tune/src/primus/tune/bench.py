"""Timing that survives a noisy GPU (run-to-run noise on the H200 is up to ~7%): candidates are measured
interleaved (each repetition runs every candidate once, in a rotating order) and compared by their medians.
Also: operands with a given BLAS layout, so a GEMM is measured exactly as training runs it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from primus.tune.shapes import GemmShape


def matrix(rows: int, cols: int, layout: str, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A ``rows × cols`` operand: row-major for ``N``, a transposed view of a row-major matrix for ``T``."""
    if layout == "T":
        return torch.randn(cols, rows, dtype=dtype, device=device).t()
    return torch.randn(rows, cols, dtype=dtype, device=device)


def operands(shape: GemmShape, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = getattr(torch, shape.dtype)
    return (
        matrix(shape.m, shape.k, shape.layout[0], dtype, device),
        matrix(shape.k, shape.n, shape.layout[1], dtype, device),
    )


# GPU cycles of host lead per timed call (~1 ms at the H200's 1.98 GHz): more than any dispatch path here needs
# to enqueue a GEMM (nvmath's Matmul.execute: ~160 us of host time, torch.mm: ~30 us; results/nvmath_dispatch_cost)
LEAD_CYCLES_PER_CALL = 2_000_000


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Returns ``time(fn, inner) -> ms per call``: CUDA events on a GPU, the wall clock on CPU.

    On a GPU the calls are timed with the host ahead: a sleep kernel is queued first, so all ``inner`` calls are
    enqueued before the GPU reaches them and run back to back. The number is then the GPU time of the kernels an
    algorithm choice changes, not the host cost of the path that launched them (which in a training step mostly
    hides behind the GPU's queue); timed in a plain loop, a path with a slower launch looked slower by up to 3x on
    small GEMMs with the very same kernel."""
    if device.type == "cuda":
        sleep = getattr(torch.cuda, "_sleep", None)

        def cuda_time(fn: Callable[[], object], inner: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if sleep is not None:
                sleep(LEAD_CYCLES_PER_CALL * inner)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / inner

        return cuda_time

    def wall_time(fn: Callable[[], object], inner: int) -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) * 1e3 / inner

    return wall_time


def interleaved_medians(
    candidates: dict[str, Callable[[], object]],
    *,
    device: str | torch.device = "cpu",
    repeats: int = 15,
    inner: int = 5,
    warmup: int = 3,
) -> dict[str, float]:
    """Median milliseconds per call of each candidate, measured in ``repeats`` interleaved rounds."""
    device = torch.device(device)
    timer = _timer(device)
    names = list(candidates)
    for name in names:
        timer(candidates[name], warmup)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]  # no candidate always runs first
        for name in order:
            samples[name].append(timer(candidates[name], inner))
    return {n: statistics.median(s) for n, s in samples.items()}


def tflops(shape: GemmShape, ms: float) -> float:
    return shape.flops / (ms * 1e-3) / 1e12 if ms > 0 else 0.0
