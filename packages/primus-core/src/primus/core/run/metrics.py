"""Metrics every backend reports the same way: the global token loss, tokens/s, TFLOP/s per device, MFU, memory.

MFU = (tokens/s per device × FLOPs per token) ÷ the device's dense bf16 peak (datasheet values
below; fp8 runs are still counted against the bf16 peak so the figures stay comparable).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# Dense (no sparsity) bf16 peak FLOP/s by device-name substring, most specific first.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("MI355X", 2500e12),
    ("MI350X", 2300e12),
    ("MI325X", 1307e12),
    ("MI300X", 1307e12),
    ("MI300A", 981e12),
    ("MI250X", 383e12),
]


def process_started() -> float | None:
    """When this process started (epoch seconds), from ``/proc`` (None elsewhere): a run's start-up counts from
    there, imports included."""
    import os

    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])  # starttime: field 22
        boot = next(int(ln.split()[1]) for ln in open("/proc/stat") if ln.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def peak_flops(device_name: str | None) -> float | None:
    """Dense bf16 peak for a device name (``torch.cuda.get_device_name()``), None if unknown (CPU)."""
    if not device_name:
        return None
    for key, value in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


def global_token_loss(sums: Any) -> float:
    """The ``loss`` metric (and the evaluation loss) from every rank's share: ``sums`` is this rank's float64 tensor
    ``[token-loss sum, tokens]`` (zeros on a rank that reports no loss, e.g. a pipeline stage before the last; ranks
    that hold copies of one pair may all add it, which leaves the ratio unchanged). Summed over the world, then the
    per-token mean: the same value on every rank, NaN if any rank's sum is. ``sums`` is reduced in place."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


@dataclass
class Throughput:
    """Accumulates tokens between log lines; call :meth:`interval` at each log step."""

    flops_per_token: float
    world_size: int
    peak: float | None
    _t0: float = field(default_factory=time.perf_counter)
    _tokens: int = 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def reset(self) -> None:
        self._t0, self._tokens = time.perf_counter(), 0

    def interval(self) -> dict[str, float]:
        dt = max(time.perf_counter() - self._t0, 1e-9)
        tps = self._tokens / dt
        tps_dev = tps / self.world_size
        tflops = tps_dev * self.flops_per_token / 1e12
        out = {"tokens_per_s": tps, "tokens_per_s_per_device": tps_dev, "tflops_per_device": tflops, "interval_s": dt}
        if self.peak:
            out["mfu"] = tflops * 1e12 / self.peak
        self.reset()
        return out


def memory_gib(device: str, reset: bool = False) -> float:
    """``memory_gib`` of the metrics (:data:`primus.core.run.loop.METRICS`): the peak memory held by tensors since
    the last reset, in GiB. On a GPU, ``torch.cuda.max_memory_allocated`` (``reset`` restarts the peak); on a CPU
    the process's peak resident set (never resets)."""
    if device != "cpu":
        import torch

        peak = torch.cuda.max_memory_allocated() / 2**30
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
