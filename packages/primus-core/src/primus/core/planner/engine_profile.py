"""What the planner knows of a training engine: its profile, which the engine's backend hands core.

The planner decides nothing by an engine's name. Which layouts an engine runs, how many bytes its weights,
gradients and optimizer keep per parameter, what its recompute keeps, where it fuses the output layer with the
loss: all of it is an :class:`EngineProfile`, which a backend names in its spec, lazily like its other refs::

    BackendSpec(name="mine", ..., planner="my_package.planner_profile:PROFILE")

(an ``EngineProfile``, or a callable that returns one). The planner looks it up by the backend's name
(:func:`profile_of`): the registry's spec of that name when the caller has a registry that holds one, else the
installed distributions' (their ``primus`` entry points: a process whose registry was built without plugin
autoload, or with others in their place, still plans an installed engine with its facts). A backend without
``planner``, or a name no installed backend has, is planned as the generic engine: :data:`GENERIC`, this class
with its defaults. So ``primus plan --engine torchtitan`` with primus-core alone plans the generic engine (and
says so), and a third-party backend is planned, with its own facts if it gives them, without an edit to core.

The generic engine (the defaults) is one that honours every parallel setting of core's config schema and keeps
the textbook mixed-precision state:

- layouts: DDP, DDP + a distributed optimizer (Adam state sharded over the replicas) and FSDP wherever there is
  more than one replica, with any TP, PP (+ VPP) and CP; recompute ``none``, ``selective`` and ``full``, and the
  schema's partial recompute (``recompute: full, recompute_method: block, recompute_layers: N``: the first N
  layers of each pipeline stage, any N).
- state per parameter (bf16 runs): bf16 weights (2 bytes), fp32 gradients (4: accumulated in fp32), an fp32 master
  copy and Adam's m, v in the optimizer (12) — 18 bytes; fp32 runs keep fp32 weights and no master copy (16).
  Gradients are reduced in fp32 (4 bytes each on the wire). FSDP holds two gathered layers and no separate
  reduce-scatter buffer. No torch.autocast weight copies (the weights already are bf16).
- activations: the formula of :mod:`primus.core.planner.memory` as derived (scale 1.0); selective recompute is
  assumed to free nothing (kept share 1.0: what it drops is the engine's to say).
- a provider's fused linear + cross-entropy is used where nothing splits the logits or the labels: not under TP
  (core's rule for every engine), PP or CP.

No field imports torch or an engine: a profile module imports primus.core only, so the planner runs anywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from primus.core.contracts.engine import BackendSpec
from primus.core.contracts.plugins import Registry, build_plugin_manager
from primus.core.contracts.protocols import load_ref
from primus.core.planner import calibration as cal

DP_MODES = ("ddp", "ddp_distopt", "fsdp")  # what a Layout's dp_mode may be
ADAM_BYTES = 8  # Adam's first and second moments, fp32, per parameter (every engine)
GemmGroups = Mapping[str, tuple[str, ...]]
NO_GROUPS: GemmGroups = MappingProxyType({})  # every linear its own GEMM


def every_dp_mode(tp: int, pp: int, dp: int) -> tuple[str, ...]:
    """The generic engine: DDP; with more than one replica also DDP + distributed optimizer and FSDP."""
    return DP_MODES if dp > 1 else ("ddp",)


def first_layers(layers_per_stage: int) -> range:
    """The generic engine's partial recompute: full recompute of the first N layers of each stage, any N."""
    return range(1, layers_per_stage)


@dataclass(frozen=True, eq=False)
class EngineProfile:
    """An engine's facts, as the planner (memory model, step-time model, layout search) uses them.

    Bytes are per parameter (or per gradient element) of the most loaded pipeline stage; "mixed" means a bf16 run
    (``train.precision`` not ``fp32``).
    """

    name: str = "generic"
    # ---------------------------------------------------------------------------------------------- layouts
    # ``dp_modes(tp, pp, dp)``: the data-parallel modes ("ddp", "ddp_distopt", "fsdp") the engine runs with these
    # sizes, in the order the search tries them (an empty result: the engine cannot run these sizes at all)
    dp_modes: Callable[[int, int, int], Sequence[str]] = every_dp_mode
    # whether ``parallel.distributed_optimizer`` shards the Adam state over the replicas (DDP + distributed optimizer)
    distributed_optimizer: bool = True
    # the recompute modes it runs, of "none", "selective", "full"
    recompute: tuple[str, ...] = ("none", "selective", "full")
    # ``partial_recompute(layers_per_stage)``: the numbers N of layers per stage it can recompute in full while
    # keeping the others' activations (None: no partial recompute)
    partial_recompute: Callable[[int], Sequence[int]] | None = first_layers
    # the ``parallel.recompute_method`` that asks for it (with recompute: full, recompute_layers: N); None where the
    # config cannot express it: ``primus plan`` shows such layouts, ``parallel.strategy: auto`` does not pick them
    partial_recompute_method: str | None = "block"
    # ------------------------------------------------------------------------------- state bytes per parameter
    weight_bytes: int = 2  # the model's weights in a mixed run (fp32 runs: 4)
    master_bytes: int = 4  # an fp32 master copy the optimizer keeps in a mixed run, besides Adam's m, v
    grad_bytes: int = 4  # the gradients (or the main-grad buffer they accumulate in)
    fsdp_grad_bytes: int | None = None  # a mixed-precision FSDP run's gradients where they differ (None: grad_bytes)
    grad_comm_bytes: int = 4  # bytes per gradient element a data-parallel reduction sends
    fsdp_reduce_buffer_bytes: int = 0  # per parameter of one layer: FSDP's reduce-scatter buffer (0: none apart)
    # mixed precision as torch.autocast over fp32 weights where FSDP does not cast them (no FSDP, or one shard):
    # the residual stream stays fp32 and autocast keeps a bf16 copy of each weight (calibration.AUTOCAST_*)
    autocast: bool = False
    # ----------------------------------------------------------------------------------------- calibration
    activation_scale: float = 1.0  # multiplier on the activation formula (1.0 = the formula as derived)
    # HBM bytes the optimizer step moves per parameter on a device (Adam's update, the master / model copies, clipping's
    # norm, the gradients' zeroing): perf.step_time; the default is one fused AdamW pass (calibration)
    optimizer_bytes_per_param: float = cal.OPTIMIZER_BYTES_PER_PARAM
    # an MoE layer's token routing (router top-k, permute / unpermute and their backward) per token, as passes of 2
    # bytes over the k · d elements of its expert copies at HBM bandwidth: perf.layer_seconds_per_token
    moe_dispatch_passes: float = cal.MOE_DISPATCH_PASSES
    # the share of the memory-bound work per token left where the norms and SwiGLU run on a provider's fused kernels
    # (KernelTerms.fused_elementwise): perf.layer_seconds_per_token; the default is a bf16-weight engine's (calibration)
    fused_kernels_kept: float = cal.FUSED_KERNELS_MEMORY_BOUND_KEPT
    selective_kept: float = 1.0  # the share of a layer's saved activations selective recompute keeps
    # -------------------------------------------------------------------------------------------- kernels
    # whether it uses a cross_entropy provider's fused linear + cross-entropy (KernelProvider feature
    # "linear_cross_entropy") in place of its output layer + loss where the layout allows
    fused_loss: bool = True
    # what makes it keep its own output layer + loss all the same, each with why: parallel dimensions ("pp", "cp")
    # and "mtp" (multi-token prediction's depths, which run the output head again)
    fused_loss_refused: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType(
            {
                "pp": "a pipeline schedule may compute the loss outside the last stage's forward",
                "cp": "context parallelism shards the labels",
            }
        )
    )

    # the block linears it runs as one GEMM (name -> the roles of primus.core.kernels.linears it joins), whose summed
    # shape FP8's shape rule weighs: megatron's linear_qkv and linear_fc1
    gemm_groups: GemmGroups = field(default_factory=lambda: NO_GROUPS)

    def fused_loss_refusal(
        self, *, tp: int, pp: int = 1, cp: int = 1, fp8_head: bool = False, mtp: bool = False
    ) -> str:
        """Why this engine keeps its own output layer + loss instead of a provider's ``linear_cross_entropy`` in
        this layout ("" where it fuses them). ``fp8_head``: the output head is an FP8 linear
        (:func:`~primus.core.kernels.fp8_recipe.fp8_output_head`), which the bf16 fused kernel would bypass."""
        if not self.fused_loss:
            return "the engine computes its own output layer and loss"
        if fp8_head:
            return "the output head is an FP8 linear (kernels.fp8_recipe.bf16_output_head: false)"
        if tp > 1:
            return "the output projection is vocab-sharded under tensor parallelism"
        for dim, on in (("pp", pp > 1), ("cp", cp > 1), ("mtp", mtp)):
            if on and dim in self.fused_loss_refused:
                return self.fused_loss_refused[dim]
        return ""


GENERIC = EngineProfile()


def backend_spec(name: str, registry: Registry | None = None) -> BackendSpec | None:
    """The backend called ``name``: ``registry``'s when it holds one, else the installed distributions'."""
    if registry is not None and name in registry.backends:
        return registry.backends[name]
    return installed_backends().get(name)


def load_profile(spec: BackendSpec | None) -> EngineProfile:
    """The profile ``spec.planner`` names (:data:`GENERIC` where there is no spec or it names none)."""
    if spec is None or spec.planner is None:
        return GENERIC
    found = load_ref(spec.planner)
    if not isinstance(found, EngineProfile) and callable(found):
        found = found()
    if not isinstance(found, EngineProfile):
        raise TypeError(
            f"backend {spec.name!r} ({spec.dist or 'unknown distribution'}): planner={spec.planner!r} gives a "
            f"{type(found).__name__}, not a primus.core.planner.engine_profile.EngineProfile"
        )
    return found


def profile_of(engine: str | EngineProfile, registry: Registry | None = None) -> EngineProfile:
    """The profile of the backend called ``engine`` (a profile is returned as it is); :data:`GENERIC` for a
    backend that gives none or a name no installed backend has."""
    if isinstance(engine, EngineProfile):
        return engine
    return load_profile(backend_spec(engine, registry))


@functools.cache
def installed_backends() -> dict[str, BackendSpec]:
    """Every backend of the installed distributions' ``primus`` entry points, through the plugin host (its
    duplicate rule) whether or not its autoload is switched off (a profile is data: the planner of a process whose
    registry left the plugins out still knows them). A plugin that fails to load is skipped (``primus plugins``
    reports it). Read once per process."""
    return dict(Registry(build_plugin_manager(autoload=True)).backends)


def fused_loss_refusal(
    engine: str | EngineProfile,
    *,
    tp: int,
    pp: int = 1,
    cp: int = 1,
    fp8_head: bool = False,
    mtp: bool = False,
    registry: Registry | None = None,
) -> str:
    """Why ``engine`` (a backend's name, or its planner profile) keeps its own output layer + loss instead of a
    provider's ``linear_cross_entropy`` in this layout ("" where it fuses them). One rule for the backends and the
    planner's memory model: :meth:`EngineProfile.fused_loss_refusal <primus.core.planner.engine_profile.EngineProfile>`
    with the engine's facts (``fused_loss``, ``fused_loss_refused``: what it cannot fuse under PP or CP).
    ``fp8_head``: the output head is an FP8 linear (:func:`~primus.core.kernels.fp8_recipe.fp8_output_head`), which
    the bf16 fused kernel would bypass; ``mtp``: the model has multi-token-prediction depths."""
    return profile_of(engine, registry).fused_loss_refusal(tp=tp, pp=pp, cp=cp, fp8_head=fp8_head, mtp=mtp)
