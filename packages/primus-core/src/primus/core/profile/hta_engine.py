"""The time shares of a run from HolisticTraceAnalysis (HTA, ``pip install 'primus-core[profile]'``), imported lazily.

What HTA computes here, per rank, on its own parse of the traces:

- the temporal breakdown: idle / compute / non-compute time over the window from the first to the last GPU kernel
  (``BreakdownAnalysis.get_temporal_breakdown``);
- the communication-computation overlap: the share of communication time during which a compute kernel runs
  (``CommunicationAnalysis.get_comm_comp_overlap``);
- the kernel-type breakdown (computation / communication / memory, ``get_gpu_kernel_breakdown``);
- CUDA launch statistics (CPU launch call against GPU kernel, launch delay) where the trace keeps the CPU side's
  ``cudaLaunchKernel`` events (``CudaKernelAnalysis.cuda_kernel_launch_stats``).

Primus's four shares follow from those: exposed communication = communication time (HTA's union of its
communication kernels) minus the overlapped part, compute = busy time minus communication time, idle = HTA's idle.
HTA puts memcpy / memset kernels in "non-compute" where primus counts them as compute (they are not
communication): the shares in primus's sense add them back, so both engines answer the same question.

HTA rounds nanosecond timestamps to whole microseconds by default (start up, end down: every kernel loses up to
2 us, about 1 point of compute share on a step of 1,900 kernels); the analysis here turns that off
(``HTA_DISABLE_NS_ROUNDING=1`` for the call) so its intervals are the trace's own.

:func:`analyze` raises :class:`Unavailable` with a one-line reason when HTA is not installed or cannot read the
traces; the caller falls back to primus's own parser (:mod:`primus.core.profile.analyze`) and says so.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

NAME = "HolisticTraceAnalysis"


class Unavailable(Exception):
    """HTA is not installed or cannot read these traces; the message says which (one line)."""


@dataclass
class HtaRank:
    window_us: float  # first GPU kernel start to last kernel end
    idle_us: float
    compute_us: float  # HTA's compute: the union of its COMPUTATION kernels
    non_compute_us: float  # communication and memory kernels not under a compute kernel
    comm_us: float  # the union of HTA's COMMUNICATION kernels
    overlap_ratio: float  # of comm_us, the share under a compute kernel (0 with no communication)
    launch: dict[str, float] | None = None

    @property
    def overlapped_us(self) -> float:
        return self.overlap_ratio * self.comm_us

    def primus_shares(self) -> dict[str, float]:
        """compute / exposed communication / overlapped communication / idle, in primus's sense, of the window."""
        w = self.window_us or 1.0
        busy = self.window_us - self.idle_us
        return {
            "compute": (busy - self.comm_us) / w,
            "exposed communication": (self.comm_us - self.overlapped_us) / w,
            "overlapped communication": self.overlapped_us / w,
            "idle": self.idle_us / w,
        }


def version() -> str | None:
    """The installed HTA's version, or None when it is not installed."""
    if importlib.util.find_spec("hta") is None:
        return None
    try:
        return importlib.metadata.version(NAME)
    except importlib.metadata.PackageNotFoundError:
        return "?"


@contextlib.contextmanager
def _quiet_exact() -> Iterator[None]:
    """HTA's logging down to errors, its nanosecond rounding off, for the duration of the call."""
    import hta.configs.config  # noqa: F401  (sets up HTA's logger, which is then turned down here)

    key, old_env = "HTA_DISABLE_NS_ROUNDING", os.environ.get("HTA_DISABLE_NS_ROUNDING")
    log = logging.getLogger("hta")
    old_level = log.level
    os.environ[key] = "1"
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy's 0/0 in the overlap of a rank without communication
            yield
    finally:
        log.setLevel(old_level)
        if old_env is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old_env


def _launch_summary(df) -> dict[str, float] | None:
    """Median / p95 launch delay and CPU launch time (us), and how many kernels ran shorter than their launch."""
    if df is None or len(df) == 0:
        return None
    return {
        "launches": float(len(df)),
        "launch_delay_median_us": float(df["launch_delay"].median()),
        "launch_delay_p95_us": float(df["launch_delay"].quantile(0.95)),
        "cpu_launch_median_us": float(df["cpu_duration"].median()),
        "gpu_shorter_than_launch": float((df["gpu_duration"] < df["cpu_duration"]).mean()),
    }


@dataclass
class HtaRun:
    ranks: dict[int, HtaRank]
    # HTA's kernel-type split of kernel time over all ranks (COMPUTATION, COMMUNICATION, MEMORY and their
    # overlaps, e.g. "COMMUNICATION overlapping COMPUTATION"), in percent
    kernel_types: dict[str, float] = field(default_factory=dict)
    version: str = ""


def analyze(traces: dict[int, Path]) -> HtaRun:
    """HTA's analysis of ``traces`` (rank -> Chrome trace file); raises :class:`Unavailable` with the reason."""
    if version() is None:
        raise Unavailable(f"{NAME} is not installed (pip install 'primus-core[profile]')")
    with _quiet_exact():
        from hta.analyzers.breakdown_analysis import BreakdownAnalysis
        from hta.analyzers.communication_analysis import CommunicationAnalysis
        from hta.analyzers.cuda_kernel_analysis import CudaKernelAnalysis
        from hta.common.trace import Trace
        from hta.utils.utils import get_kernel_type, merge_kernel_intervals

        files = {rank: str(Path(p).resolve()) for rank, p in traces.items()}
        try:
            t = Trace(trace_files=files, trace_dir=str(Path(next(iter(files.values()))).parent))
            # in this process (HTA forks a pool by default); every traced step, as primus's window has
            t.load_traces(include_last_profiler_step=True, use_multiprocessing=False, use_memory_profiling=False)
        except Exception as exc:  # HTA's parser raises what it meets (KeyError, ValueError, AssertionError...)
            raise Unavailable(f"{NAME} cannot read the trace ({type(exc).__name__}: {exc})") from None
        for rank in t.traces:
            if not t.get_trace(rank)["stream"].ne(-1).any():
                raise Unavailable(f"{NAME} cannot read this trace: it has no GPU kernels (a CPU-only trace)")
        try:
            temporal = BreakdownAnalysis.get_temporal_breakdown(t, visualize=False).set_index("rank")
            overlap = CommunicationAnalysis.get_comm_comp_overlap(t, visualize=False).set_index("rank")
            types, _ = BreakdownAnalysis.get_gpu_kernel_breakdown(t, visualize=False, num_kernels=1)
            launches = CudaKernelAnalysis.cuda_kernel_launch_stats(t, list(t.traces), visualize=False)
        except Exception as exc:
            raise Unavailable(f"{NAME} failed on this trace ({type(exc).__name__}: {exc})") from None
        sym = t.symbol_table.get_sym_table()
        out = {}
        for rank in t.traces:
            df = t.get_trace(rank)
            gpu = df[df["stream"].ne(-1)].copy()
            gpu["kernel_type"] = gpu["name"].map(lambda i: get_kernel_type(sym[i]))
            comm = gpu[gpu["kernel_type"].eq("COMMUNICATION")].copy()
            comm_us = 0.0
            if len(comm):
                merged = merge_kernel_intervals(comm)
                comm_us = float(merged["end"].sum() - merged["ts"].sum())
            row = temporal.loc[rank]
            ratio = float(overlap.loc[rank, "comp_comm_overlap_pctg"]) / 100 if comm_us else 0.0  # HTA rounds: 0.01%
            out[rank] = HtaRank(
                window_us=float(row["kernel_time(us)"]),
                idle_us=float(row["idle_time(us)"]),
                compute_us=float(row["compute_time(us)"]),
                non_compute_us=float(row["non_compute_time(us)"]),
                comm_us=comm_us,
                overlap_ratio=0.0 if math.isnan(ratio) else ratio,
                launch=_launch_summary(launches.get(rank)),
            )
        split = {str(r["kernel_type"]): float(r["percentage"]) for _, r in types.iterrows()}
        return HtaRun(out, split, version() or "")
