"""Where step time goes, from Chrome trace JSON (torch.profiler's ``export_chrome_trace``), one or many ranks.

Per rank, on the device timeline (events of category ``kernel``, ``gpu_memcpy``, ``gpu_memset``; on a
CPU-only trace the top-level ``cpu_op`` events stand in), over the window from the first to the last
device event:

- compute: covered by a compute (non-communication) kernel and by no communication kernel;
- exposed communication: covered by a communication kernel and by no compute kernel;
- overlapped communication: covered by both;
- idle: covered by nothing.

These four add up to the window, and no instant is counted twice (they are computed on the union of
intervals). Kernels are also put in categories (GEMM, attention, norm, elementwise/activation,
communication, optimizer, memory, other; for mixture-of-experts models grouped GEMM, all-to-all and routing) by name,
each kernel in exactly one, with their summed time (overlapping kernels each count fully there) and the top kernels
by time.

The step time is the window over the number of traced steps (torch.profiler's ``ProfilerStep#N``
annotations). MFU needs the model FLOPs of a step: the ``"primus"`` block StepProfiler writes into
the trace (:func:`primus.core.profile.capture.trace_metadata`), or ``flops_per_step`` / ``peak_flops``
given by the caller.

:func:`analyze_run` is what the CLI calls: it takes the four time shares from HolisticTraceAnalysis where that
library is installed and can read the traces (:mod:`primus.core.profile.hta_engine`; GPU traces), else from the
parser here, and says which in one line (``RunAnalysis.engine_line``). Kernel categories, the FP8 share, MFU, top
kernels and the picture of one step (``RankReport.timeline``) always come from here.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}

# Order matters: the first pattern that matches names the category.
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    # mixture-of-experts' expert-parallel token exchange where the kernel says so (gloo, CPU traces; NCCL runs an
    # all-to-all as SendRecv kernels, which stay "communication" with pipeline sends)
    ("all_to_all", re.compile(r"all_?to_?all", re.I)),
    (
        "communication",
        re.compile(
            r"nccl|rccl|allreduce|all_reduce|allgather|all_gather|reducescatter|reduce_scatter|"
            r"sendrecv|alltoall|broadcast|c10d::|gloo",
            re.I,
        ),
    ),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|cudnn.*(mha|sdpa)|_efficient_", re.I)),
    # "lamb" as a word only: CUDA's elementwise kernels name their functor "{lambda(float, float)#1}"
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|optimizer|\blamb\b|lamb_|sgd_", re.I)),
    # mixture-of-experts' expert GEMMs: torch's grouped_mm (CUTLASS 3's GroupProblemShape kernels on Hopper; the
    # aten op in CPU traces) and grouped_gemm-style kernels
    ("grouped_gemm", re.compile(r"GroupProblemShape|grouped_mm|grouped_?gemm|GroupedGemm|\bgmm\b", re.I)),
    (
        "gemm",
        re.compile(
            r"gemm|cutlass|xmma|nvjet|cublas|hipblaslt|Cijk_|matmul|\bmm\b|aten::mm|aten::addmm|linearwith|triton_tem_|"
            r"aten::bmm|aten::linear|sm90_|sm80_|wgmma|scaled_mm|mmbackward",  # CPU traces: autograd's (Add|B)mmBackward0
            re.I,
        ),
    ),
    ("norm", re.compile(r"rms_?norm|layer_?norm|layernorm|norm_kernel|batch_norm|mean.*rsqrt|rsqrt.*mean", re.I)),
    ("memory", re.compile(r"memcpy|memset|copy_|aten::copy|aten::to\b|cat\b|aten::cat", re.I)),
    (
        "elementwise",
        re.compile(
            r"elementwise|vectorized|silu|swiglu|gelu|relu|sigmoid|softmax|add|mul|div|exp|"
            r"rope|rotary|where|fill|reduce|sum|mean|pow|rsqrt|neg|triton_",
            re.I,
        ),
    ),
]


# GEMM kernels with FP8 operands, by name. cuBLASLt's nvjet kernels spell their operand types after the arch
# (t bf16, s fp32, q e4m3, r e5m2): every bf16 H200 trace here runs nvjet_sm90_tst_*, the FP8 runs nvjet_sm90_qqtst_,
# _qrtst_ and _qrsss_* (benchmarks/results/profile_3b_fp8_fastacc_mbs8.txt). CUTLASS names the fp8 type; hipBLASLt's
# Cijk_* kernels carry F8 in their type field (not seen here: no AMD GPU); a CPU trace shows aten::_scaled_mm.
FP8_GEMM = re.compile(r"nvjet_sm\d+_[qr]{2}|e4m3|e5m2|float8|_scaled_mm|Cijk_\w*F8", re.I)


# inductor's pointwise / reduction kernels are named after every op they fuse, a GEMM's neighbours included
# (triton_poi_fused_..._scaled_mm_silu is an FP8 cast): never a GEMM (its GEMM templates are triton_tem_*)
INDUCTOR_FUSED = re.compile(r"^triton_(poi|red|per)_")


# Kernels that carry data between ranks: the communication lane of the time shares
COMMUNICATION = frozenset({"communication", "all_to_all"})

# A mixture-of-experts run's routing (the router's top-k, sorting tokens by expert, counting them, gathering and
# scattering them to and from the experts' order): in such a trace (one with grouped-GEMM or all-to-all kernels) these
# generic kernels are the routing's; in a dense model's the same names (the loss's gather, the embedding's backward)
# are not, so they are taken as routing only there.
ROUTING = re.compile(
    r"topk|top_k|sort|radix|histogram|histc|permute_indices|fill_indices|index_select|indexFunc|index_put|"
    r"indexing_backward|scatter|gather|moe_|router|token_(dispatch|combine)",
    re.I,
)


def categorize(name: str, moe: bool = False) -> str:
    """The kernel category of ``name``; ``moe``: the trace is a mixture-of-experts run's (:data:`ROUTING` applies)."""
    fused = INDUCTOR_FUSED.match(name) is not None
    for cat, pat in CATEGORIES:
        # routing ranks just above the generic categories its kernels' names also match (elementwise, memory)
        if moe and cat == "gemm" and ROUTING.search(name) and not pat.search(name):
            return "routing"
        if pat.search(name) and not (fused and cat in ("gemm", "grouped_gemm")):
            return cat
    return "other"


def is_moe_trace(names: list[str]) -> bool:
    """Whether kernels of a mixture-of-experts layer (grouped GEMMs, all-to-alls) are among ``names``."""
    return any(categorize(n) in ("grouped_gemm", "all_to_all") for n in set(names))


@dataclass
class RankReport:
    rank: str
    window_us: float
    compute_us: float
    exposed_comm_us: float
    overlapped_comm_us: float
    idle_us: float
    categories: dict[str, float] = field(default_factory=dict)
    top: list[tuple[str, float, int]] = field(default_factory=list)
    steps: int = 1
    kernels: int = 0
    model_flops_per_step: float | None = None
    peak_flops: float | None = None
    fp8_gemm_us: float = 0.0  # of the "gemm" category: kernels with FP8 operands (FP8_GEMM)
    # one step, for the report's picture: (lane, start us, end us, what) from the step's start; lane "busy" holds
    # the time shares (compute / exposed or overlapped communication), the others one stream each (kernel categories)
    timeline: list[tuple[str, float, float, str]] = field(default_factory=list)
    timeline_us: float = 0.0
    top_categories: dict[str, str] = field(default_factory=dict)  # top kernel name -> category
    # set by HolisticTraceAnalysis (primus.core.profile.hta_engine) when it produced the time shares
    hta: dict[str, float] | None = None
    launch: dict[str, float] | None = None
    on_device: bool = False  # GPU kernels (False: a CPU-only trace, its top-level operators stand in)
    meta: dict = field(default_factory=dict)  # the trace's "primus" block (model, backend, device, layout...)

    @property
    def step_us(self) -> float:
        return self.window_us / max(self.steps, 1)

    @property
    def mfu(self) -> float | None:
        """Model FLOPs of a step ÷ (step time × dense bf16 peak); None without both numbers."""
        if not (self.model_flops_per_step and self.peak_flops and self.window_us):
            return None
        return self.model_flops_per_step / (self.step_us * 1e-6) / self.peak_flops

    def shares(self) -> dict[str, float]:
        w = self.window_us or 1.0
        return {
            "compute": self.compute_us / w,
            "exposed communication": self.exposed_comm_us / w,
            "overlapped communication": self.overlapped_comm_us / w,
            "idle": self.idle_us / w,
        }


STEP_MARK = re.compile(r"^ProfilerStep#\d+$")


def read_trace(path: Path) -> tuple[list[dict], dict]:
    """The complete ("X") events of a Chrome trace (.json or .json.gz) and its ``"primus"`` block ({} if none)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    meta = data.get("primus", {}) if isinstance(data, dict) else {}
    return [e for e in events if e.get("ph") == "X" and "dur" in e], meta


def count_steps(events: list[dict]) -> int:
    """Traced steps: distinct ``ProfilerStep#N`` annotations (at least 1)."""
    return max(len({e["name"] for e in events if STEP_MARK.match(str(e.get("name", "")))}), 1)


def _device_events(events: list[dict]) -> list[dict]:
    dev = [e for e in events if e.get("cat") in DEVICE_CATS]
    if dev:
        return dev
    # CPU-only trace: the outermost operators of each thread stand in for kernels
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e.get("tid"), e["ts"]))
    top, end_by_tid = [], {}
    for e in ops:
        if e["ts"] >= end_by_tid.get(e.get("tid"), float("-inf")):
            top.append(e)
            end_by_tid[e.get("tid")] = e["ts"] + e["dur"]
    return top


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


TIMELINE_PIXELS = 1200  # intervals closer than a pixel of this width are drawn as one


def _step_window(events: list[dict], start: float, end: float, steps: int) -> tuple[float, float]:
    """The first traced step on the device: its GPU ``ProfilerStep#N`` annotation, else the CPU one (a CPU trace),
    else the first 1/steps of the window."""
    for cat in ("gpu_user_annotation", "user_annotation"):
        marks = [e for e in events if e.get("cat") == cat and STEP_MARK.match(str(e.get("name", "")))]
        if marks:
            first = min(marks, key=lambda e: e["ts"])
            lo, hi = max(first["ts"], start), min(first["ts"] + first["dur"], end)
            if hi > lo:
                return lo, hi
    return start, start + (end - start) / max(steps, 1)


def _merged(segments: list[tuple[float, float, str]], gap: float) -> list[tuple[float, float, str]]:
    out: list[list] = []
    for s, e, what in sorted(segments):
        if out and out[-1][2] == what and s - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e, what])
    return [(s, e, w) for s, e, w in out]


def _states(cu: list[tuple[float, float]], mu: list[tuple[float, float]]) -> list[tuple[float, float, str]]:
    """The busy time split into compute / exposed communication / overlapped communication segments."""
    points = sorted({p for iv in (*cu, *mu) for p in iv})
    out, i, j = [], 0, 0
    for a, b in zip(points, points[1:], strict=False):
        mid = (a + b) / 2
        while i < len(cu) and cu[i][1] <= mid:
            i += 1
        while j < len(mu) and mu[j][1] <= mid:
            j += 1
        c = i < len(cu) and cu[i][0] <= mid
        m = j < len(mu) and mu[j][0] <= mid
        if c or m:
            out.append((a, b, "overlapped communication" if c and m else "compute" if c else "exposed communication"))
    return out


def _timeline(
    events: list[dict], dev: list[dict], cats: list[str], start: float, end: float, steps: int
) -> tuple[list[tuple[str, float, float, str]], float]:
    lo, hi = _step_window(events, start, end, steps)
    gap = (hi - lo) / TIMELINE_PIXELS
    gpu = any(e.get("cat") in DEVICE_CATS for e in dev)
    lanes: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    cu, mu = [], []
    for e, cat in zip(dev, cats, strict=True):
        s, t = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if t <= s:
            continue
        lane = f"stream {e.get('args', {}).get('stream', e.get('tid'))}" if gpu else f"thread {e.get('tid')}"
        lanes[lane].append((s - lo, t - lo, cat))
        (mu if cat in COMMUNICATION else cu).append((s - lo, t - lo))
    out = [("busy", s, e, w) for s, e, w in _merged(_states(_union(cu), _union(mu)), gap)]
    for lane in sorted(lanes, key=lambda name: (len(name), name)):
        out += [(lane, s, e, w) for s, e, w in _merged(lanes[lane], gap)]
    return out, hi - lo


def analyze_events(
    events: list[dict],
    rank: str = "0",
    top_n: int = 10,
    flops_per_step: float | None = None,
    peak_flops: float | None = None,
) -> RankReport:
    dev = _device_events(events)
    steps = count_steps(events)
    if not dev:
        return RankReport(rank, 0, 0, 0, 0, 0, steps=steps)
    start = min(e["ts"] for e in dev)
    end = max(e["ts"] + e["dur"] for e in dev)
    comm, compute = [], []
    cats: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(list)
    fp8_gemm = 0.0
    moe = is_moe_trace([e["name"] for e in dev])
    names = [categorize(e["name"], moe) for e in dev]
    for e, cat in zip(dev, names, strict=True):
        cats[cat] += e["dur"]
        if cat == "gemm" and FP8_GEMM.search(e["name"]):
            fp8_gemm += e["dur"]
        per_kernel[e["name"]].append(e["dur"])
        (comm if cat in COMMUNICATION else compute).append((e["ts"], e["ts"] + e["dur"]))
    cu, mu = _union(compute), _union(comm)
    both = _intersection(cu, mu)
    busy = _length(cu) + _length(mu) - both
    top = sorted(((n, sum(d), len(d)) for n, d in per_kernel.items()), key=lambda t: -t[1])[:top_n]
    timeline, timeline_us = _timeline(events, dev, names, start, end, steps)
    report = RankReport(
        rank,
        end - start,
        _length(cu) - both,
        _length(mu) - both,
        both,
        (end - start) - busy,
        dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        top,
        steps,
        len(dev),
        flops_per_step,
        peak_flops,
        fp8_gemm,
        timeline,
        timeline_us,
        {n: categorize(n, moe) for n, _, _ in top},
    )
    report.on_device = any(e.get("cat") in DEVICE_CATS for e in dev)
    return report


def analyze_files(
    paths: list[Path], top_n: int = 10, flops_per_step: float | None = None, peak_flops: float | None = None
) -> list[RankReport]:
    """One report per trace; ``flops_per_step`` / ``peak_flops`` (per device) override the trace's own block."""
    reports = []
    for i, path in enumerate(paths):
        m = re.search(r"rank[_-]?(\d+)", path.name)
        events, meta = read_trace(path)
        flops = flops_per_step or meta.get("model_flops_per_step_per_device")
        peak = peak_flops or meta.get("peak_flops")
        report = analyze_events(events, m.group(1) if m else str(i), top_n, flops, peak)
        report.meta = meta
        reports.append(report)
    return reports


ENGINES = ("auto", "hta", "primus")


@dataclass
class RunAnalysis:
    """The reports of one run's traces, which engine produced the time shares (one line), the trace's
    ``"primus"`` block (model, backend, device, layout, kernels) and HTA's kernel-type split where it ran."""

    reports: list[RankReport]
    engine: str = "primus"  # "hta" or "primus"
    engine_line: str = "Time shares from primus's built-in trace parser."
    meta: dict = field(default_factory=dict)
    kernel_types: dict[str, float] = field(default_factory=dict)
    label: str = ""


def _hta_line(version: str) -> str:
    return (
        f"Time shares, communication overlap, kernel types and CUDA launches from HolisticTraceAnalysis {version}; "
        "kernel categories, FP8 share, MFU and top kernels from primus's trace parser."
    )


def analyze_run(
    paths: list[Path],
    top_n: int = 10,
    flops_per_step: float | None = None,
    peak_flops: float | None = None,
    engine: str = "auto",
    label: str = "",
) -> RunAnalysis:
    """Every trace of a run, with HolisticTraceAnalysis's time shares where it can read them (``engine`` "auto"
    or "hta"; "hta" raises :class:`~primus.core.profile.hta_engine.Unavailable` where it cannot), else primus's
    own (the fallback, named in ``engine_line``). Kernel categories, FP8 share, MFU and top kernels are primus's."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    reports = analyze_files(paths, top_n, flops_per_step, peak_flops)
    run = RunAnalysis(reports, meta=reports[0].meta if reports else {}, label=label)
    if engine == "primus":
        return run
    from primus.core.profile import hta_engine

    ranks = {int(r.rank) if r.rank.isdigit() else i: r for i, r in enumerate(reports)}
    try:
        if len(ranks) != len(reports):
            raise hta_engine.Unavailable("HolisticTraceAnalysis needs one trace per rank (two files name one rank)")
        if not all(r.on_device for r in reports):
            # no GPU kernels: HTA has nothing to read, and importing it takes seconds
            raise hta_engine.Unavailable("HolisticTraceAnalysis cannot read this trace: no GPU kernels (CPU-only)")
        result = hta_engine.analyze({rank: path for rank, path in zip(ranks, paths, strict=True)})
    except hta_engine.Unavailable as exc:
        if engine == "hta":
            raise
        run.engine_line = f"Time shares from primus's built-in trace parser: {exc}."
        return run
    for rank, r in ranks.items():
        h = result.ranks[rank]
        shares = h.primus_shares()
        r.window_us = h.window_us
        r.compute_us = shares["compute"] * h.window_us
        r.exposed_comm_us = shares["exposed communication"] * h.window_us
        r.overlapped_comm_us = shares["overlapped communication"] * h.window_us
        r.idle_us = h.idle_us
        w = h.window_us or 1.0
        r.hta = {
            "compute": h.compute_us / w,
            "non-compute": h.non_compute_us / w,
            "idle": h.idle_us / w,
        }
        if h.comm_us:  # the share of communication time under a compute kernel: none without communication
            r.hta["comm-comp overlap"] = h.overlap_ratio
        r.launch = h.launch
    run.engine, run.engine_line, run.kernel_types = "hta", _hta_line(result.version), result.kernel_types
    return run


TRACE_SUFFIXES = (".json", ".json.gz")


def find_traces(path: Path) -> list[Path]:
    """The traces of a run: a trace file itself, or the traces in a folder (``rank*.json``, any ``*.json(.gz)``),
    or its ``traces/`` sub-folder (a run's output folder), or the ``traces/`` beside it (its ``profile/`` folder)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no such trace or folder: {path}")
    # a run's folder first looks in its traces/: its own summary.json is not a trace
    for folder in (path / "traces", path, path.parent / "traces"):
        found = sorted(p for p in folder.glob("*") if p.is_file() and p.name.endswith(TRACE_SUFFIXES))
        if found:
            return found
    raise FileNotFoundError(f"no Chrome trace (*.json, *.json.gz) in {path}, {path / 'traces'} or beside it")
