"""Enumerate the layouts an engine can run on a cluster, keep those that fit, rank by estimated step time.

Which data-parallel modes and recompute options an engine runs is its profile's to say
(:class:`~primus.core.planner.profile.EngineProfile`: ``dp_modes``, ``recompute``, ``partial_recompute``).

Ties (equal estimated time, e.g. DDP with and without the distributed optimizer) go to the layout
that needs less memory, then to the one with fewer parallel dimensions. Nothing here is a lookup:
which strategy wins follows from the memory model (memory.py) and the time model (perf.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from primus.core.config.schema import ModelConfig
from primus.core.modelmath import flops_per_token
from primus.core.planner.hardware import Device
from primus.core.planner.memory import GIB, PLAIN_KERNELS, KernelTerms, Layout, MemoryBreakdown, estimate
from primus.core.planner.perf import StepTime, step_time
from primus.core.planner.profile import GENERIC, EngineProfile, profile_of

if TYPE_CHECKING:
    from primus.core.plugins import Registry

USABLE = 0.9  # of device memory: headroom for allocator spikes and fragmentation the model does not see
DEFAULT_BATCH_TOKENS = 4 * 2**20  # tokens per step when the config sets no global batch (Llama 3 used 4M+)


@dataclass(frozen=True)
class Cluster:
    device: Device
    nodes: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def capacity(self) -> float:
        return self.device.memory_gib * GIB * USABLE


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryBreakdown
    time: StepTime
    fits: bool
    tokens_per_s_per_device: float
    mfu: float

    def key(self) -> tuple:
        lay = self.layout
        dims = sum(x > 1 for x in (lay.tp, lay.pp, lay.vpp, lay.cp))
        return (not self.fits, round(self.time.total, 9), round(self.memory.total / GIB, 3), dims)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_options(model: ModelConfig, gpus_per_node: int) -> list[int]:
    out = []
    for t in (1, 2, 4, 8):
        kv_ok = model.num_kv_heads % t == 0 or t % model.num_kv_heads == 0
        if t <= gpus_per_node and model.num_attention_heads % t == 0 and kv_ok:
            out.append(t)
    return out


def _recompute_options(engine: EngineProfile, lps: int) -> list[tuple[str, int]]:
    """The engine's recompute modes, then its partial recompute (N layers of each stage), least recompute first."""
    opts = [(rc, 0) for rc in engine.recompute]
    if engine.partial_recompute is not None:
        opts += [("partial", n) for n in engine.partial_recompute(lps)]
    return opts


def evaluate(
    model: ModelConfig,
    layout: Layout,
    seq_len: int,
    global_batch: int,
    cluster: Cluster,
    precision: str,
    kernels: KernelTerms = PLAIN_KERNELS,
) -> Candidate:
    mem = estimate(model, layout, seq_len, precision, kernels)
    t = step_time(model, layout, seq_len, global_batch, cluster.device, cluster.gpus_per_node, kernels)
    tps = global_batch * seq_len / t.total / layout.world
    mfu = tps * flops_per_token(model, seq_len) / cluster.device.peak_flops
    return Candidate(layout, mem, t, mem.total <= cluster.capacity, tps, mfu)


def candidates(
    model: ModelConfig,
    cluster: Cluster,
    seq_len: int,
    micro_batch: int = 1,
    global_batch: int | None = None,
    engine: str | EngineProfile = GENERIC,
    precision: str = "bf16",
    kernels: KernelTerms = PLAIN_KERNELS,
    registry: Registry | None = None,
) -> list[Candidate]:
    """Every layout ``engine`` can run on ``cluster``, best first, with the run's ``kernels`` counted. ``engine``:
    a backend's name (its profile looked up in ``registry``, else among the installed backends; the generic
    engine's where none is found) or a profile."""
    profile = profile_of(engine, registry)
    name = engine if isinstance(engine, str) else profile.name
    gbs = global_batch or max(1, DEFAULT_BATCH_TOKENS // seq_len)
    out: list[Candidate] = []
    for tp in _tp_options(model, cluster.gpus_per_node):
        # uneven splits are allowed (the last stages take a layer less, as Megatron's
        # decoder_last_pipeline_num_layers and TorchTitan's module splitting allow): 126 layers on PP 16
        pps = sorted(
            {p for p in _divisors(model.num_layers) if p <= 32} | {p for p in (2, 4, 8, 16, 32) if p < model.num_layers}
        )
        for pp in pps:
            if cluster.world % (tp * pp):
                continue
            dp = cluster.world // (tp * pp)
            if gbs % (micro_batch * dp):
                continue
            m = gbs // (micro_batch * dp)
            lps = math.ceil(model.num_layers / pp)
            vpps = [1] + [v for v in (2, 4) if pp > 1 and lps % v == 0 and m % pp == 0]
            for vpp in vpps:
                for mode in profile.dp_modes(tp, pp, dp):
                    best_partial: Candidate | None = None
                    for rc, n in _recompute_options(profile, lps):
                        layout = Layout(name, mode, dp, tp, pp, vpp, 1, rc, n, micro_batch, m, profile)
                        cand = evaluate(model, layout, seq_len, gbs, cluster, precision, kernels)
                        if rc != "partial":
                            out.append(cand)
                        elif cand.fits and best_partial is None:
                            best_partial = cand  # options are in increasing recompute: the first that fits
                    if best_partial is not None:
                        out.append(best_partial)
    return sorted(out, key=Candidate.key)


def best(cands: list[Candidate]) -> Candidate | None:
    return cands[0] if cands and cands[0].fits else None
