"""The patches primus-megatron makes on megatron-core, in one table, and the version check.

Two releases are supported, chosen by the interpreter (pyproject's environment markers): megatron-core 0.16.1 on
Python < 3.12 (the newest release there) and 0.19.2 on Python >= 3.12 (every release from 0.17 requires it).
:func:`check_version` refuses any other, and :data:`MCORE_0_19` is the one place the package branches on which is
installed: the functions here that read it are the only version-specific code (each names its release).

:data:`PATCHES` lists each patch or private override the package makes on megatron-core (here, and in cpu.py,
gpt.py, rope.py, fp8.py, layer_spec.py, model.py), and each adapter to an API that differs between the two releases:
what it replaces, why, and the test that fails when the engine changes under it. A patch is a last resort: one small
named function per engine behaviour. Everything else that talks to megatron-core imports it where it is used
(process groups: dist.py, the model: model.py, sharded state dicts: checkpoint.py).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch

from primus.core.contracts.patches import Patch

PATCHES: tuple[Patch, ...] = (
    Patch(
        "compat.optimizer_step",
        "get_grad_norm / step_with_ready_grads of megatron's ChainedOptimizer, replaced on the instance for one step()",
        "step() runs grad norm, clip and update in one method (0.16, 0.19); the health gate decides between norm and "
        "update",
        "test_compat.py::test_optimizer_step_runs_norm_then_update",
    ),
    Patch(
        "compat.fuse_torch_adam (torch_adams, _steps_on_param_device)",
        "the param groups of the torch Adam(W) megatron builds without TE/apex (fused=True), plus a step pre-hook "
        "putting each state's `step` on its parameter's device",
        "megatron builds torch's Adam with its default (foreach) implementation; fused is 1.09x on the H200",
        "test_compat.py::test_fused_adam_switch_reaches_megatrons_torch_adam",
    ),
    Patch(
        "compat.foreach_multi_tensor (foreach_l2_norm, foreach_scale)",
        "module globals megatron.core.optimizer.clip_grads.l2_norm_impl / multi_tensor_scale_impl and "
        "megatron.core.optimizer.optimizer.multi_tensor_scale_impl, where they hold megatron's local fallbacks",
        "the local l2 norm syncs the host once per parameter tensor; the local scale copies a temporary per tensor",
        "test_compat.py::test_foreach_multi_tensor_replaces_megatrons_local_fallbacks",
    ),
    Patch(
        "compat.prepare_optimizer_for_load",
        "calls the private DistributedOptimizer._init_optimizer_states_with_dummy_values before a load",
        "DistributedOptimizer.state_dict asserts one Adam step across parameters (0.16, 0.19); torch's AdamW has no "
        "state before its first step",
        "test_compat.py::test_distributed_optimizer_step_workarounds_still_needed",
    ),
    Patch(
        "compat.restore_adam_step",
        "torch AdamW's per-parameter state['step'] after a distributed-optimizer load",
        "the dp_reshardable format drops the per-parameter step and copies the dummy one over the restored value "
        "(0.16, 0.19): Adam's bias correction would restart at 1",
        "test_compat.py::test_distributed_optimizer_step_workarounds_still_needed",
    ),
    Patch(
        "compat.checkpoint_writer_dies_with_rank",
        "the module global megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue, pre-filled",
        "the Manager server megatron spawns on the first save (0.16: _get_write_results_queue, 0.19: "
        "get_write_results_queue) outlives a SIGKILLed rank, holding its stdout/stderr",
        "test_compat.py::test_checkpoint_writer_results_queue_is_a_module_global",
    ),
    Patch(
        "compat.llama3_rope_constants",
        "model.rotary_pos_emb.inv_freq, recomputed with the private RotaryEmbedding._apply_scaling",
        "GPTModel takes only the llama3 scaling factor (0.16, 0.19); low/high freq factors and original length are "
        "fixed",
        "test_compat.py::test_gpt_model_rope_arguments, test_compat.py::test_kernel_modules_match_megatron_local_modules",
    ),
    Patch(
        "compat.PLUGGABLE_ACTIVATION_FLAG",
        "TransformerConfig.use_te_activation_func set true with a non-TE activation module",
        "the MLP calls submodules.activation_func on the whole fc1 output only under this flag; the name says TE but "
        "the slot takes any module",
        "test_compat.py::test_spec_slots_the_backend_fills",
    ),
    Patch(
        "fsdp.FSDP2 (finish_grad_sync, scale_gradients)",
        "a subclass of TorchFullyShardedDataParallel overriding two methods of its base _BaseDataParallel",
        "finalize_model_grads passes force_all_reduce, which the base finish_grad_sync does not take (0.16, 0.19); "
        "the base scale_gradients is a no-op, and fine-tuning's per-token loss scales the gradients by 1 / tokens",
        "test_compat.py::test_fsdp2_wrapper_gaps_still_there",
    ),
    Patch(
        "compat.moe_without_te",
        "the module global megatron.core.transformer.moe.moe_utils.te_general_gemm, set to None where it is missing",
        "0.16.1's router gating linear tests `te_general_gemm is not None` but defines the name only when Transformer "
        "Engine imports: without TE every MoE forward raises NameError",
        "test_compat.py::test_moe_utils_misses_te_general_gemm_without_te",
    ),
    Patch(
        "fsdp.optimizer_param_ids",
        "the module global megatron.core.dist_checkpointing.optimizer.get_optim_param_to_id_map",
        "megatron matches optimizer parameters to the model's sharded tensors by id(to_local()); torch 2.13's "
        "DTensor.to_local() of a parameter is a fresh view, so an FSDP2 optimizer could not be saved",
        "test_compat.py::test_fsdp2_optimizer_ids_still_by_to_local",
    ),
    Patch(
        "cpu.redirect_to_cpu (cpu.PATCHES: current_device, device_mesh, moe_splits, rng, streams, device_literals)",
        "torch.cuda.current_device / set_device / device_count, DeviceMesh.from_group's 'cuda' (FSDP2's mesh), "
        "the MoE token dispatcher's maybe_move_tensor_to_cpu (split sizes as numpy), "
        "the torch.cuda RNG functions, pin_memory=True, megatron's "
        "tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state, torch.cuda streams, events and "
        "synchronize, and a process-wide TorchFunctionMode for device='cuda' and CUDA tensor types (CPU only)",
        "megatron-core assumes CUDA throughout",
        "test_cpu_redirect.py::test_megatron_uses_current_device_as_a_device, "
        "test_cpu_redirect.py::test_megatron_rng_tracker_uses_cuda_rng, "
        "test_cpu_redirect.py::test_megatron_uses_streams_and_synchronize, "
        "test_cpu_redirect.py::test_megatron_asserts_cuda_tensor_types, "
        "test_cpu_redirect.py::test_patches_redirect_cuda_to_cpu, "
        "test_cpu_redirect.py::test_megatron_fsdp2_builds_a_cuda_mesh, "
        "test_cpu_redirect.py::test_megatron_pins_host_memory_for_cp_rope, "
        "test_cpu_redirect.py::test_megatron_moe_splits_become_numpy_only_off_a_gpu",
    ),
    Patch(
        "gpt.FusedLossGPTModel._postprocess (gpt.fuse_loss)",
        "override of the private GPTModel._postprocess; the built GPTModel instance is retyped",
        "the output layer and loss as one fused call that never materialises the logits (TP = 1, no MTP: 0.19 runs "
        "the MTP layers inside _postprocess; an output_processor (0.19) keeps megatron's)",
        "test_compat.py::test_fused_loss_postprocess_matches_gptmodel, "
        "test_compat.py::test_kernel_modules_match_megatron_local_modules",
    ),
    Patch(
        "rope.KernelRoPESelfAttention",
        "overrides of SelfAttention.forward and SelfAttention.get_query_key_value_tensors",
        "megatron applies RoPE inside SelfAttention.forward (no spec slot): its forward runs without RoPE and q/k "
        "are rotated by the provider where they are produced",
        "test_compat.py::test_rope_override_points_are_megatrons",
    ),
    Patch(
        "fp8.linear_classes (Fp8ColumnParallelLinear, Fp8RowParallelLinear)",
        "the private _forward_impl of ColumnParallelLinear / RowParallelLinear, and ColumnParallelLinear.allreduce_dgrad",
        "FP8 GEMMs inside megatron's tensor-parallel linears (same parameters, state dict and TP communication); 0.19 "
        "also passes gtp_remat_size, refused above 1 (a GTP-sharded weight)",
        "test_compat.py::test_fp8_linears_override_megatrons_forward_impl",
    ),
    Patch(
        "layer_spec.KernelCoreAttention, KernelRMSNorm, KernelSwiGLU",
        "the layer spec's core_attention, norm and activation_func slots (megatron's extension point), built with "
        "the keyword arguments Attention passes core attention",
        "the selected kernel providers inside megatron's own layers",
        "test_compat.py::test_spec_slots_the_backend_fills, test_compat.py::test_kernel_modules_match_megatron_local_modules",
    ),
    Patch(
        "model.transformer_config (interleaved pipelines)",
        "TransformerConfig.batch_p2p_comm=False, overlap_p2p_comm=True when vpp > 1",
        "batched p2p posts send_prev before send_next (0.16, 0.19); with pp = 2 one peer is both neighbours and "
        "receives them in the wrong buffers",
        "test_compat.py::test_interleaved_pipeline_uses_unbatched_p2p",
    ),
    Patch(
        "experts.StackedExperts",
        "the MoE layer's experts slot, built as megatron builds SequentialMLP (num_local_experts, config, "
        "pg_collection=, and from 0.19 name=) and called as it calls it",
        "the routed experts as grouped GEMMs over stacked weights, in SequentialMLP's checkpoint format",
        "test_compat.py::test_stacked_experts_are_built_and_called_as_megatrons_experts",
    ),
    Patch(
        "compat.dense_mlp",
        "the transformer layer's mlp slot: a ModuleSpec of MLP (0.16), megatron's builder MLP.as_mlp_submodule (0.19)",
        "0.19 calls the slot with (config, pg_collection, is_mtp_layer, name) and rewraps a ModuleSpec of MLP into "
        "that builder itself, warning at every layer",
        "test_compat.py::test_dense_mlp_slot",
    ),
    Patch(
        "compat.mtp_layer_submodules",
        "MultiTokenPredictionLayerSubmodules' transformer layer slot: transformer_layer (0.16), mtp_model_layer (0.19)",
        "0.19 renamed the slot (and the module attribute; its sharded state dict keeps the old key names)",
        "test_compat.py::test_mtp_depth_slot_and_router_rows, test_compat.py::test_mla_latent_norms_come_from_the_spec",
    ),
    Patch(
        "compat.router_layer",
        "reads TopKRouter.layer_number (and 0.19's is_mtp_layer) for the row of megatron's per-layer MoE records",
        "0.19 numbers a multi-token-prediction depth's router by its depth and adds num_layers only where it records; "
        "0.16 numbers it after the decoder's layers",
        "test_compat.py::test_mtp_depth_slot_and_router_rows, test_compat.py::test_mla_latent_norms_come_from_the_spec",
    ),
    Patch(
        "compat.take_mtp_losses",
        "reads and clears megatron's MTPLossLoggingHelper.tracker: values / clean_loss_in_tracker (0.16), "
        "loss_values / clean_metrics_in_tracker (0.19)",
        "the mtp_loss metric comes from megatron's own record of it; 0.19 renamed both",
        "test_compat.py::test_mtp_depth_slot_and_router_rows, test_compat.py::test_mla_latent_norms_come_from_the_spec",
    ),
    Patch(
        "compat.batch_on_this_cp_rank",
        "calls megatron.core.utils.get_batch_on_this_cp_rank with the context-parallel group, and 0.19's "
        "is_hybrid_cp=False",
        "0.19 added the required is_hybrid_cp and splits over the whole world for cp_group=None",
        "test_compat.py::test_cp_batch_arguments",
    ),
    Patch(
        "compat.mla_without_te",
        "the module globals HAVE_TE / TELinear / TEColumnParallelLinear (0.16) and Linear (0.19) of "
        "megatron.core.transformer.multi_latent_attention",
        "MLASelfAttention type-checks its linears against TE's names; without TE, 0.16 leaves placeholders there "
        "(isinstance raises) and 0.19 sets the replicated Linear it accepts for the down projections to None",
        "test_compat.py::test_mla_reads_its_linear_types_from_module_globals",
    ),
    Patch(
        "compat.mla_self_attention (0.19: SpecNormsMLASelfAttention._resolve_qk_norm_config)",
        "the private MLASelfAttention._resolve_qk_norm_config of 0.19, returning the spec's latent norms and up "
        "projections",
        "0.19 resolves them from config.qk_layernorm, refusing the spec's latent norms with it off and needing TE's "
        "fused norm + linear for a full q projection with it on",
        "test_compat.py::test_mla_latent_norms_come_from_the_spec, "
        "test_fp8.py::test_core_shape_table_is_the_model_megatron_builds",
    ),
)

#: the megatron-core releases primus-megatron is written against, and the interpreters that install each
SUPPORTED = {"0.16.1": "Python < 3.12", "0.19.2": "Python >= 3.12"}


def check_version(found: str) -> str:
    """``found`` when it is a supported megatron-core release; otherwise a RuntimeError in one line that names the
    supported ones and the one this interpreter takes."""
    if found not in SUPPORTED:
        want = "0.19.2" if sys.version_info >= (3, 12) else "0.16.1"
        both = " and ".join(f"{v} ({py})" for v, py in SUPPORTED.items())
        raise RuntimeError(
            f"primus-megatron supports megatron-core {both}, found {found}: pip install 'megatron-core=={want}'"
        )
    return found


INSTALLED = check_version(version("megatron-core"))
#: megatron-core 0.19.2 rather than 0.16.1: the one version branch of the package
MCORE_0_19 = INSTALLED == "0.19.2"

# The MLP calls ``submodules.activation_func`` (a module built with ``config=``) on the whole fc1
# output only when this flag is set; the name says TE but the slot takes any module (0.16 and 0.19).
PLUGGABLE_ACTIVATION_FLAG = "use_te_activation_func"


def llama3_rope_constants(model: Any, kv_channels: int, rope_theta: float, rope_scaling: Any) -> None:
    """0.16's GPTModel takes only the llama3 scaling factor (``rope_scaling_factor``; low/high freq factors and the
    original length are fixed at 1, 4, 8192): where the config's differ, recompute the built model's
    ``rotary_pos_emb.inv_freq`` with megatron's own private ``RotaryEmbedding._apply_scaling``."""
    if (
        rope_scaling.low_freq_factor,
        rope_scaling.high_freq_factor,
        rope_scaling.original_max_position_embeddings,
    ) == (1.0, 4.0, 8192):
        return
    rot = model.rotary_pos_emb
    dim = kv_channels
    base = 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rot.inv_freq.device) / dim))
    rot.inv_freq = rot._apply_scaling(
        base,
        factor=rope_scaling.factor,
        low_freq_factor=rope_scaling.low_freq_factor,
        high_freq_factor=rope_scaling.high_freq_factor,
        original_max_position_embeddings=rope_scaling.original_max_position_embeddings,
    )


def optimizer_step(optimizer: Any, gate: Callable[[float | None], bool] | None = None) -> tuple[bool, float | None]:
    """(update applied, grad norm before clipping).

    0.16's ``get_megatron_optimizer`` returns a ``ChainedOptimizer`` whose ``step()`` runs
    ``prepare_grads`` (model grads -> main grads) -> ``get_grad_norm`` (the global norm, reduced over
    every rank that holds gradients, so all ranks see the same value) -> clip -> ``step_with_ready_grads``
    (the inner optimizer step, main -> model params, the distributed optimizer's param all-gather)
    and returns (success, grad_norm, num_zeros). ``gate(grad_norm)`` is asked between the norm and the
    update, on every rank alike; it may raise to stop the run. When it says False the update is not
    applied: parameters, main params and optimizer state (Adam moments and step count) stay as they
    were; only the step's gradients were touched (clipped), and the next step zeroes them.
    """
    if gate is None:
        ok, grad_norm, _ = optimizer.step()
        return bool(ok), grad_norm
    seen: dict[str, float | None] = {}
    get_grad_norm, step_with_ready_grads = optimizer.get_grad_norm, optimizer.step_with_ready_grads

    def recorded_grad_norm() -> float | None:
        seen["norm"] = get_grad_norm()
        return seen["norm"]

    def gated_update() -> bool:
        return step_with_ready_grads() if gate(seen.get("norm")) else False

    optimizer.get_grad_norm, optimizer.step_with_ready_grads = recorded_grad_norm, gated_update
    try:
        ok, grad_norm, _ = optimizer.step()
    finally:  # back to the class's methods
        del optimizer.get_grad_norm, optimizer.step_with_ready_grads
    return bool(ok), grad_norm


def torch_adams(optimizer: Any) -> list[Any]:
    """The torch ``Adam``/``AdamW`` instances inside 0.16's optimizer wrappers (``ChainedOptimizer`` ->
    ``chained_optimizers`` -> Float16/Distributed optimizer -> ``.optimizer``). Without Transformer Engine or apex,
    megatron-core builds them itself (``USING_PYTORCH_OPTIMIZER``), with torch's default implementation."""
    inner = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [o for o in inner if isinstance(o, torch.optim.Adam | torch.optim.AdamW)]


def fuse_torch_adam(optimizer: Any) -> int:
    """Switch megatron's torch Adam(W) to torch's fused kernels (one launch for all parameters; torch picks
    ``foreach`` by default, which the H200 profiles put at a third of a Llama 3.2 1B step). The update is the
    same Adam(W); only the implementation changes. Returns the number of parameter groups switched."""
    switched = 0
    for adam in torch_adams(optimizer):
        for group in adam.param_groups:
            group["fused"], group["foreach"] = True, False
            switched += 1
        adam.register_step_pre_hook(_steps_on_param_device)
    return switched


def _steps_on_param_device(adam: Any, args: Any, kwargs: Any) -> None:
    # the fused kernels want each parameter's step count on its device; states megatron's distributed optimizer
    # restores from a checkpoint (or foreach made) keep it on the CPU
    for param, state in adam.state.items():
        step = state.get("step")
        if step is not None and step.device != param.device:
            state["step"] = step.to(param.device, dtype=torch.float32)


def foreach_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list, per_tensor: bool, *args: Any) -> tuple:
    """megatron's ``multi_tensor_l2norm`` contract (the l2 norm over every tensor of every list, as a 1-element
    fp32 tensor on their device; per-tensor norms when asked) on torch's foreach norm: no host sync."""
    tensors = [t for tensors in tensor_lists for t in tensors]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32), None
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    return torch.linalg.vector_norm(norms).reshape(1), (norms if per_tensor else None)


def foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: list, scale: float) -> None:
    """megatron's ``multi_tensor_scale`` contract (``dst = src * scale`` over two lists, in place when they are the
    same tensors) on torch's foreach kernels, without a temporary per tensor."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def foreach_multi_tensor() -> list[str]:
    """Where megatron-core fell back to its local multi-tensor helpers (neither Transformer Engine nor apex is
    installed), put torch's foreach kernels in their place. The local l2 norm turns each gradient's norm into a
    Python float (``torch.tensor`` of a list of device scalars: a host sync per parameter, ~150 per step for Llama
    3.2 1B, each stalling the GPU) and the local scale builds ``src * scale`` per tensor before copying it; same
    values, a few launches and no sync here. Returns the slots replaced (none where apex / TE provide them)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mp_optimizer

    local = {utils.local_multi_tensor_l2_norm: foreach_l2_norm, utils.local_multi_tensor_scale: foreach_scale}
    slots = [
        (clip_grads, "l2_norm_impl"),
        (clip_grads, "multi_tensor_scale_impl"),
        (mp_optimizer, "multi_tensor_scale_impl"),
    ]
    replaced = []
    for module, name in slots:
        ours = local.get(getattr(module, name))
        if ours is not None:
            setattr(module, name, ours)
            replaced.append(f"{module.__name__}.{name}")
    return replaced


def prepare_optimizer_for_load(optimizer: Any) -> None:
    """Give a fresh distributed optimizer the state layout it will load into.

    0.16's ``DistributedOptimizer.state_dict()`` (called to build the sharded state dict for
    loading) asserts a single Adam ``step`` across parameters; torch's AdamW (used when neither TE
    nor apex is installed) has no state before its first step, so the assert fails. megatron's
    own dummy-state initialiser (a zero-grad step) fills it; the load then overwrites it.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()


def restore_adam_step(optimizer: Any, loaded: dict) -> None:
    """Put back torch AdamW's per-parameter ``step`` after a distributed-optimizer load.

    0.16's ``dp_reshardable`` format saves params, exp_avg and exp_avg_sq per bucket but not the
    per-parameter ``step`` tensors torch's AdamW keeps, then copies the (dummy) ``step`` of the
    request over the one it had restored from the saved param groups: Adam's bias correction
    would restart at 1 and a resumed run would drift from the straight one. The saved param
    groups hold the right value.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    for i, opt in enumerate(opts):
        sd = loaded if len(opts) == 1 else loaded[i]
        if not isinstance(opt, DistributedOptimizer) or not isinstance(opt.optimizer, torch.optim.Optimizer):
            continue
        steps = {g.get("step") for g in sd["optimizer"]["param_groups"]} - {None}
        if len(steps) == 1:
            step = float(steps.pop())
            for state in opt.optimizer.state.values():
                if "step" in state:
                    state["step"] = torch.tensor(step, dtype=torch.float32)


_writer_manager: Any = None  # keeps megatron's write-results server alive for the life of the rank


def checkpoint_writer_dies_with_rank() -> None:
    """Start megatron's checkpoint write-results server so that it ends with its rank (Linux).

    0.16's ``FileSystemWriterAsync`` (the ``torch_dist`` save) hands write results through
    ``filesystem_async._get_write_results_queue()``: a ``multiprocessing`` Manager server spawned on
    the first save and kept in the module global ``_results_queue``. When the rank dies by SIGKILL
    the server is orphaned and lives on, holding the rank's stdout/stderr, so a launcher that pipes
    them (``primus train ... | tee``, a test) never sees them close. Started here first, with the
    parent-death signal set, it goes down with the rank; megatron then reuses it.
    """
    global _writer_manager
    import sys
    from multiprocessing import get_context
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from primus.megatron.procs import die_with_parent

    if _writer_manager is not None or filesystem_async._results_queue is not None or sys.platform != "linux":
        return
    manager = SyncManager(ctx=get_context("spawn"))
    manager.start(initializer=die_with_parent)
    filesystem_async._results_queue = manager.Queue()
    _writer_manager = manager


def moe_without_te() -> bool:
    """Give megatron's MoE utilities the ``te_general_gemm = None`` they test for (see :data:`PATCHES`); True when it
    was missing."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def batch_on_this_cp_rank(batch: dict[str, Any]) -> dict[str, Any]:
    """This context-parallel rank's share of ``batch`` (megatron's ``get_batch_on_this_cp_rank``: chunks r and
    2·cp-1-r of 2·cp along the sequence, every tensor of ``[b, s]``; None values stay None). 0.19 made
    ``is_hybrid_cp`` a required argument and no longer looks up megatron's context-parallel group for
    ``cp_group=None`` (it would split over the whole world): the group is passed on both releases."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = parallel_state.get_context_parallel_group()
    if MCORE_0_19:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


def mla_without_te() -> list[str]:
    """The names megatron-core's multi-latent-attention module reads to type-check its down projections, as they are
    without Transformer Engine; returns the ones changed.

    0.16 imports TE's extension (which imports without TE, its classes placeholders) and sets ``HAVE_TE``: its
    ``isinstance(linear_proj, TELinear)`` test then raises, so ``HAVE_TE`` / ``TELinear`` / ``TEColumnParallelLinear``
    are set as its own except branch would. 0.19 reads ``HAVE_TE`` from the extension (False) but then sets
    ``Linear``, the replicated linear it accepts for the down projections (:func:`primus.megatron.deepseek.whole_linear`),
    to None with the TE names: it gets modelopt's ``Linear``, the class 0.16 has there."""
    import inspect

    from megatron.core.transformer import multi_latent_attention as mla

    changed = []
    if mla.HAVE_TE and not inspect.isclass(mla.TELinear):  # 0.16
        mla.HAVE_TE = False
        mla.TELinear = mla.TEColumnParallelLinear = None
        changed += ["HAVE_TE", "TELinear", "TEColumnParallelLinear"]
    if mla.Linear is None:  # 0.19
        from megatron.core.post_training.modelopt.layers import Linear

        mla.Linear = Linear
        changed.append("Linear")
    return changed


#: the MLASelfAttention submodules 0.19's ``_resolve_qk_norm_config`` chooses (built as the spec gives them)
MLA_RESOLVED = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "q_layernorm", "kv_layernorm")


@functools.cache
def mla_self_attention() -> type:
    """megatron's MLASelfAttention building the latent norms and up projections the layer spec gives it.

    0.16 builds them from the spec. 0.19 picks them in ``_resolve_qk_norm_config`` (megatron's
    ``QKNormConfigResolver``) from ``config.qk_layernorm``: off, it refuses the spec's latent norms; on, with no
    ``q_lora_rank`` (DeepSeek-V2-Lite, Moonlight), it wants a norm fused into ``linear_q_proj``, which only Transformer
    Engine provides. Primus's spec holds DeepSeek's model (both latent norms, no norm before a full q projection), so
    on 0.19 the override returns the spec's modules, as 0.16 builds them."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if not MCORE_0_19:
        return MLASelfAttention

    class SpecNormsMLASelfAttention(MLASelfAttention):
        def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
            return {name: getattr(submodules, name) for name in MLA_RESOLVED}

    return SpecNormsMLASelfAttention


def dense_mlp(submodules: Any) -> Any:
    """The transformer layer's ``mlp`` slot for megatron's MLP with these submodules. 0.16 builds a ``ModuleSpec`` of
    MLP, passing MLP's own keyword arguments; 0.19 calls the slot with (config, pg_collection, is_mtp_layer, name) and
    wants the builder for that, ``MLP.as_mlp_submodule`` (a ``ModuleSpec`` of MLP it rewraps into one itself, warning
    at every layer it builds)."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    if MCORE_0_19:
        return functools.partial(MLP.as_mlp_submodule, submodules=submodules)
    return ModuleSpec(module=MLP, submodules=submodules)


def mtp_layer_submodules(layer: Any, **modules: Any) -> Any:
    """``MultiTokenPredictionLayerSubmodules`` with ``layer`` (the depth's transformer layer spec) in the slot 0.16 names
    ``transformer_layer`` and 0.19 ``mtp_model_layer``; ``modules``: its norms and ``eh_proj``. (0.19's sharded state
    dict maps the new name's keys back to ``transformer_layer.``: checkpoints and Hugging Face names stay the same.)"""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayerSubmodules

    return MultiTokenPredictionLayerSubmodules(**{"mtp_model_layer" if MCORE_0_19 else "transformer_layer": layer},
                                               **modules)  # fmt: skip


def router_layer(router: Any) -> int:
    """A TopKRouter's row in megatron's per-layer MoE records, 0-based: the decoder's layers, then the
    multi-token-prediction depths. 0.16 numbers a depth's layer after the decoder's (``num_layers + k``); 0.19 numbers
    it ``k``, marks its router ``is_mtp_layer`` and adds ``num_layers`` where it records."""
    if MCORE_0_19 and router.is_mtp_layer:
        return router.layer_number - 1 + router.config.num_layers
    return router.layer_number - 1


def take_mtp_losses() -> Any:
    """megatron's record of the multi-token-prediction losses since it was last taken (each training forward on the
    last pipeline stage adds its micro-batch's mean cross-entropy per depth: a tensor [depths]; None before the
    first), a copy, and the record cleared. 0.16 keeps it in ``MTPLossLoggingHelper.tracker["values"]`` and clears it
    with ``clean_loss_in_tracker``; 0.19 in ``tracker["loss_values"]`` (beside its acceptance counts) with
    ``clean_metrics_in_tracker``."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper as helper

    values = helper.tracker.get("loss_values" if MCORE_0_19 else "values")
    if values is None:
        return None
    values = values.clone()
    (helper.clean_metrics_in_tracker if MCORE_0_19 else helper.clean_loss_in_tracker)()
    return values


#: Python warnings megatron-core raises on every rank about its own code, nothing a user can change (filtered by
#: primus.megatron.dist with its 0.16 ones): 0.19's optimizer builder imports its experimental multimodal model class
#: on every call, which warns at import; its checkpoint loader calls DCP's load with positional arguments and, for the
#: common state, in one process (each warned by torch on every resume).
ENGINE_WARNINGS = (
    ("MimoModelConfig is experimental", "The argument order of load has been changed",
     "torch.distributed is disabled, unavailable or uninitialized")
    if MCORE_0_19
    else ()
)  # fmt: skip
#: log lines megatron-core 0.19 writes about its own calls (logger -> message start): a synchronous save goes through
#: its deprecated async writer and says so; DDP computes the distributed optimizer's parameter layout itself and asks
#: callers to pass one (the one it computes: Primus's would be the same call); GPTModel announces its deprecation in
#: favour of HybridModel at every build (it still takes bug fixes; moving to HybridModel is a change of its own)
ENGINE_LOG_LINES = (
    {
        "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED.",
        "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
        "megatron.core.distributed.distributed_data_parallel": "DistributedDataParallel: full_param_layout not provided",
    }
    if MCORE_0_19
    else {}
)
