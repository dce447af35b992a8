"""Enumerate the layouts an engine can run on a cluster, keep those that fit, rank by estimated step time.

Which data-parallel modes and recompute options an engine runs is its profile's to say
(:class:`~primus.core.planner.engine_profile.EngineProfile`: ``dp_modes``, ``recompute``, ``partial_recompute``); whether
the engine's backend accepts a layout is its own validation's (``check``: :func:`primus.core.planner.auto.refusals`
builds it from a config and the backend's ``BackendSpec.validate``).

A layout fits when its estimate stays within the cluster's budget: the usable memory less a headroom
(:attr:`Cluster.headroom`; ``primus plan`` and ``parallel.strategy: auto`` keep the memory model's error band,
``calibration.HEADROOM``). Where several micro-batch sizes are given, each layout is evaluated with each that splits
the global batch and keeps the fastest that fits (and that the backend accepts). Ties (equal estimated time, e.g. DDP
with and without the distributed optimizer) go to the layout that needs less memory, then to the one with fewer
parallel dimensions. Nothing here is a lookup: which strategy wins follows from the memory model (memory.py) and the
time model (perf.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from primus.core.config.schema import LoRAConfig, ModelConfig
from primus.core.planner import calibration as cal
from primus.core.planner.engine_profile import GENERIC, EngineProfile, profile_of
from primus.core.planner.hardware import Device
from primus.core.planner.memory import GIB, PLAIN_KERNELS, KernelTerms, Layout, MemoryBreakdown, estimate
from primus.core.planner.modelmath import flops_per_token
from primus.core.planner.perf import StepTime, step_time

if TYPE_CHECKING:
    from primus.core.contracts.plugins import Registry

USABLE = 0.9  # of device memory: headroom for allocator spikes and fragmentation the model does not see
DEFAULT_BATCH_TOKENS = 4 * 2**20  # tokens per step when the config sets no global batch (Llama 3 used 4M+)
MICRO_BATCHES = (1, 2, 4, 8, 16)  # the micro-batch sizes `primus plan` tries (those that split the global batch)


@dataclass(frozen=True)
class Cluster:
    device: Device
    nodes: int
    gpus_per_node: int
    # the share of the usable memory a layout must leave free to fit (``primus plan`` and ``parallel.strategy: auto``
    # keep ``calibration.HEADROOM``, the estimate's own error band; 0: a layout may fill the usable memory)
    headroom: float = 0.0

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def capacity(self) -> float:
        """Usable memory per device (bytes): the device's less what the allocator and the runtime keep."""
        return self.device.memory_gib * GIB * USABLE

    @property
    def budget(self) -> float:
        """What a layout's estimate may reach (bytes): the usable memory less the headroom."""
        return self.capacity * (1 - self.headroom)


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryBreakdown
    time: StepTime
    fits: bool  # within the cluster's budget
    tokens_per_s_per_device: float
    mfu: float
    # why the engine's backend refuses this layout ("path: message" each; empty: it accepts it, or nothing checked)
    refused: tuple[str, ...] = ()

    @property
    def runnable(self) -> bool:
        """It fits and the backend accepts it: what the planner may recommend."""
        return self.fits and not self.refused

    def key(self) -> tuple:
        lay = self.layout
        dims = sum(x > 1 for x in (lay.tp, lay.pp, lay.vpp, lay.cp, lay.ep))
        return (not self.runnable, round(self.time.total, 9), round(self.memory.total / GIB, 3), dims)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _ep_options(model: ModelConfig, dp: int) -> list[int]:
    """Expert-parallel sizes for ``dp`` data-parallel ranks: powers of two that divide the experts and the ranks
    (1 for a dense model)."""
    if model.moe is None:
        return [1]
    return [e for e in (1, 2, 4, 8, 16, 32, 64, 128) if model.moe.num_experts % e == 0 and dp % e == 0]


def _cp_options(seq_len: int, ranks: int) -> list[int]:
    """Context-parallel sizes for a sequence of ``seq_len`` over ``ranks`` (dp · cp) devices: 1, and for long
    sequences (``calibration.CP_MIN_SEQ_LEN``) powers of two that divide the ranks and split the sequence into 2 · cp
    equal chunks (the load-balanced causal layout) of at least ``CP_MIN_TOKENS_PER_RANK`` tokens per rank."""
    if seq_len < cal.CP_MIN_SEQ_LEN:
        return [1]
    return [1] + [
        c
        for c in (2, 4, 8, 16, 32)
        if ranks % c == 0 and seq_len % (2 * c) == 0 and seq_len // c >= cal.CP_MIN_TOKENS_PER_RANK
    ]


def _tp_options(model: ModelConfig, gpus_per_node: int) -> list[int]:
    out = []
    for t in (1, 2, 4, 8):
        kv_ok = model.num_kv_heads % t == 0 or t % model.num_kv_heads == 0
        if t <= gpus_per_node and model.num_attention_heads % t == 0 and kv_ok:
            out.append(t)
    return out


def evaluate(
    model: ModelConfig,
    layout: Layout,
    seq_len: int,
    global_batch: int,
    cluster: Cluster,
    precision: str,
    kernels: KernelTerms = PLAIN_KERNELS,
    lora: LoRAConfig | None = None,
) -> Candidate:
    mem = estimate(model, layout, seq_len, precision, kernels, lora)
    t = step_time(model, layout, seq_len, global_batch, cluster.device, cluster.gpus_per_node, kernels, lora)
    tps = global_batch * seq_len / t.total / layout.world
    mfu = tps * flops_per_token(model, seq_len, lora) / cluster.device.peak_flops
    return Candidate(layout, mem, t, mem.total <= cluster.budget, tps, mfu)


def _partial(
    layouts: list[Layout], evaluated: Callable[[Layout], Candidate], judged: Callable[[Candidate], Candidate]
) -> list[Candidate]:
    """Of one layout's partial recomputes (``layouts``, in increasing recompute, so in decreasing memory): the first
    that fits and the backend accepts, else the first that fits (reported as refused); none where none fits. The first
    that fits is found by bisection, so only a few are estimated."""
    lo, hi = 0, len(layouts)
    while lo < hi:
        mid = (lo + hi) // 2
        if evaluated(layouts[mid]).fits:
            hi = mid
        else:
            lo = mid + 1
    first: Candidate | None = None
    for layout in layouts[lo:]:
        cand = judged(evaluated(layout))
        if not cand.refused:
            return [cand]
        first = first or cand
    return [first] if first is not None else []


def _better(a: Candidate, b: Candidate) -> bool:
    """Of one layout's variants (``b`` found first): one the planner may recommend over one it may not; of two it may,
    the faster, ``b`` where they tie (the micro-batch sizes are tried in the order given); of two it may not, the
    smaller (what "nothing fits" reports)."""
    if a.runnable != b.runnable:
        return a.runnable
    if not a.runnable:
        return a.memory.total < b.memory.total
    return a.time.total < b.time.total and not math.isclose(a.time.total, b.time.total, rel_tol=1e-9)


def candidates(
    model: ModelConfig,
    cluster: Cluster,
    seq_len: int,
    micro_batch: int | Sequence[int] = 1,
    global_batch: int | None = None,
    engine: str | EngineProfile = GENERIC,
    precision: str = "bf16",
    kernels: KernelTerms = PLAIN_KERNELS,
    registry: Registry | None = None,
    check: Callable[[Layout], Sequence[str]] | None = None,
    lora: LoRAConfig | None = None,
) -> list[Candidate]:
    """Every layout ``engine`` can run on ``cluster``, best first, with the run's ``kernels`` counted. ``engine``:
    a backend's name (its profile looked up in ``registry``, else among the installed backends; the generic
    engine's where none is found) or a profile. ``micro_batch``: the micro-batch size, or the sizes to try in order of
    preference (each layout then comes once, with the fastest; of equally fast ones the first). ``check(layout)``:
    the backend's refusals of a layout (None: none checked), kept in :attr:`Candidate.refused`; a layout it refuses is
    never ranked above one it accepts. ``lora``: the run's ``train.lora`` (frozen base weights, trained adapters:
    :func:`~primus.core.planner.memory.estimate`)."""
    profile = profile_of(engine, registry)
    name = engine if isinstance(engine, str) else profile.name
    gbs = global_batch or max(1, DEFAULT_BATCH_TOKENS // seq_len)
    sizes = [micro_batch] if isinstance(micro_batch, int) else list(dict.fromkeys(micro_batch))

    def judged(cand: Candidate) -> Candidate:
        return replace(cand, refused=tuple(check(cand.layout))) if check is not None else cand

    # the best of each layout over the micro-batch sizes (a partial recompute: over its numbers of layers too)
    kept: dict[tuple, Candidate] = {}
    for tp in _tp_options(model, cluster.gpus_per_node):
        # uneven splits are enumerated (the last stages take a layer less, as Megatron's
        # decoder_last_pipeline_num_layers and TorchTitan's module splitting allow): 126 layers on PP 16; a backend
        # that does not run them refuses them in its validation (``check``)
        pps = sorted(
            {p for p in _divisors(model.num_layers) if p <= 32} | {p for p in (2, 4, 8, 16, 32) if p < model.num_layers}
        )
        for pp in pps:
            if cluster.world % (tp * pp):
                continue
            lps = math.ceil(model.num_layers / pp)
            for cp, mb in ((c, b) for c in _cp_options(seq_len, cluster.world // (tp * pp)) for b in sizes):
                dp = cluster.world // (tp * pp * cp)
                if gbs % (mb * dp):
                    continue
                m = gbs // (mb * dp)
                vpps = [1] + [
                    v for v in (2, 3, 4) if pp > 1 and lps % v == 0 and m % pp == 0 and pp * v <= model.num_layers
                ]  # every model chunk holds a layer (61 layers: not PP 32 × VPP 2)
                # experts split the data- and context-parallel ranks (their tokens differ)
                for vpp, ep in ((v, e) for v in vpps for e in _ep_options(model, dp * cp)):
                    for mode in profile.dp_modes(tp, pp, dp * cp):  # gradients reduce over dp · cp
                        found = [
                            judged(evaluate(model, lay, seq_len, gbs, cluster, precision, kernels, lora))
                            for lay in (
                                Layout(name, mode, dp, tp, pp, vpp, cp, rc, 0, mb, m, profile, ep)
                                for rc in profile.recompute
                            )
                        ]
                        if profile.partial_recompute is not None:
                            found += _partial(
                                [
                                    Layout(name, mode, dp, tp, pp, vpp, cp, "partial", n, mb, m, profile, ep)
                                    for n in profile.partial_recompute(lps)
                                ],
                                lambda lay: evaluate(model, lay, seq_len, gbs, cluster, precision, kernels, lora),
                                judged,
                            )
                        for cand in found:
                            lay = cand.layout
                            key = (mode, dp, tp, pp, vpp, lay.cp, lay.ep, lay.recompute)
                            if key not in kept or _better(cand, kept[key]):
                                kept[key] = cand
    return sorted(kept.values(), key=Candidate.key)


def best(cands: list[Candidate]) -> Candidate | None:
    """The first of ``cands`` (ranked by :func:`candidates`) if the planner may recommend it."""
    return cands[0] if cands and cands[0].runnable else None
