"""``primus preflight``: is this machine (and its network) fit to train, before a long run is launched?

Each rank measures, on its device: a bf16 GEMM (TFLOP/s), a device-to-device copy (memory bandwidth),
and, when launched on several ranks, all-reduce and all-gather (bus bandwidth, as nccl-tests report it:
all-reduce moves 2(n−1)/n of the buffer per rank, all-gather (n−1)/n). Collective results are checked
for the right values, not only timed. Checks pass when a rate reaches ``THRESHOLD`` of the device's
datasheet figure; on a device without a known figure (a CPU) only correctness is judged.
"""

from __future__ import annotations

import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from primus.core.run.metrics import peak_flops

THRESHOLD = 0.6  # of the datasheet rate; a healthy H200 reaches ~80% in GEMM (benchmarks/results/h200_baseline.md) and in copies

# Datasheet HBM bandwidth, bytes/s, by device-name substring.
PEAK_MEMORY_BW: list[tuple[str, float]] = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("B200", 8.0e12),
    ("A100", 2.0e12),
    ("MI355X", 8.0e12),
    ("MI325X", 6.0e12),
    ("MI300X", 5.3e12),
]


@dataclass
class Check:
    name: str
    value: float
    unit: str
    peak: float | None = None
    ok: bool = True
    note: str = ""

    @property
    def fraction(self) -> float | None:
        return self.value / self.peak if self.peak else None


@dataclass
class RankResult:
    rank: int
    device: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in (
        "torch",
        "triton",
        "megatron-core",
        "torchtitan",
        "primus-core",
        "primus-megatron",
        "primus-torchtitan",
        "primus-turbo",
        "primus-tune",
    ):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "-"
    return out


def _timeit(fn, sync, iters: int) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def _peak_bw(name: str) -> float | None:
    return next((v for k, v in PEAK_MEMORY_BW if k.lower() in name.lower()), None)


def _judge(check: Check) -> Check:
    if check.peak:
        check.ok = check.value >= THRESHOLD * check.peak
        check.note = f"{check.fraction:.0%} of datasheet" + ("" if check.ok else f" (< {THRESHOLD:.0%})")
    return check


def run_checks(gemm_size: int = 8192, copy_mib: int = 1024, comm_mib: int = 256, iters: int = 10) -> RankResult:
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dev = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res = RankResult(rank, name)
    dtype = torch.bfloat16 if cuda else torch.float32

    n = gemm_size
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    dt = _timeit(lambda: a @ b, sync, iters)
    res.checks.append(
        _judge(
            Check(
                f"GEMM {n}³ {str(dtype).removeprefix('torch.')}",
                2 * n**3 / dt / 1e12,
                "TFLOP/s",
                (peak_flops(name) or 0) / 1e12 or None,
            )
        )
    )
    a = b = None  # free before the next check

    numel = copy_mib * 2**20 // 4
    src, dst = torch.empty(numel, device=dev), torch.empty(numel, device=dev)
    dt = _timeit(lambda: dst.copy_(src), sync, iters)
    peak = _peak_bw(name)
    res.checks.append(
        _judge(Check(f"copy {copy_mib} MiB", 2 * numel * 4 / dt / 1e9, "GB/s", peak / 1e9 if peak else None))
    )
    src = dst = None

    if dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        numel = comm_mib * 2**20 // 4
        buf = torch.full((numel,), float(rank + 1), device=dev)
        dist.all_reduce(buf)
        want = world * (world + 1) / 2
        ok = bool(torch.all(buf == want))
        dt = _timeit(lambda: dist.all_reduce(buf), sync, iters)
        res.checks.append(
            Check(
                f"all-reduce {comm_mib} MiB × {world}",
                2 * (world - 1) / world * numel * 4 / dt / 1e9,
                "GB/s busbw",
                ok=ok,
                note="" if ok else f"wrong sum (want {want})",
            )
        )
        # all_gather_into_tensor is deprecated in torch 2.13 for all_gather_single, which torch 2.11 lacks
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
        part = torch.full((numel // world,), float(rank), device=dev)
        out = torch.empty(numel // world * world, device=dev)
        dist.all_gather_into_tensor(out, part)
        ok = bool(torch.all(out.view(world, -1)[:, 0] == torch.arange(world, device=dev, dtype=out.dtype)))
        dt = _timeit(lambda: dist.all_gather_into_tensor(out, part), sync, iters)
        res.checks.append(
            Check(
                f"all-gather {comm_mib} MiB × {world}",
                (world - 1) / world * numel * 4 / dt / 1e9,
                "GB/s busbw",
                ok=ok,
                note="" if ok else "wrong data",
            )
        )
    return res


def run(**sizes: Any) -> list[RankResult]:
    """Run on this rank; with torchrun, every rank's result is gathered (returned on every rank)."""
    import torch
    import torch.distributed as dist

    launched = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        mine = run_checks(**sizes)
        if not launched:
            return [mine]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, asdict(mine))
        return [RankResult(g["rank"], g["device"], [Check(**c) for c in g["checks"]]) for g in gathered]
    finally:
        if launched:
            dist.destroy_process_group()
