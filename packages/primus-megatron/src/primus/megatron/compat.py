"""Everything that is specific to megatron-core 0.16.1: import paths and call signatures that move
between releases. The rest of the backend imports megatron only through this module (and cpu.py,
the CPU-only patches), so a pin change is a change here; ``tests/test_compat.py`` names what moved.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch

PINNED = "0.16.1"
INSTALLED = version("megatron-core")

if INSTALLED != PINNED:  # pragma: no cover - the pin in pyproject keeps these equal
    warnings.warn(f"primus-megatron is written for megatron-core {PINNED}, found {INSTALLED}", stacklevel=1)

# megatron warns once per process about every optional fused kernel it cannot find (TE, apex):
# expected on a local-spec build; keep them out of the run log.
for _pattern in ("Transformer Engine", "TransformerEngine", "Apex", "apex"):
    warnings.filterwarnings("ignore", message=f".*{_pattern}.*")

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.mlp import MLP, MLPSubmodules  # noqa: E402
from megatron.core.transformer.module import Float16Module, MegatronModule  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_block import (  # noqa: E402
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules  # noqa: E402

__all__ = [
    "AttnMaskType",
    "BlendedMegatronDatasetBuilder",
    "ColumnParallelLinear",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "Float16Module",
    "GPTDataset",
    "GPTDatasetConfig",
    "GPTModel",
    "IdentityOp",
    "MLP",
    "MLPSubmodules",
    "MegatronModule",
    "ModuleSpec",
    "OptimizerConfig",
    "OptimizerParamScheduler",
    "RowParallelLinear",
    "SelfAttention",
    "SelfAttentionSubmodules",
    "TransformerBlockSubmodules",
    "TransformerConfig",
    "TransformerLayer",
    "TransformerLayerSubmodules",
    "dist_checkpointing",
    "finalize_model_grads",
    "get_bias_dropout_add",
    "get_forward_backward_func",
    "get_megatron_optimizer",
    "get_num_layers_to_build",
    "parallel_state",
    "tensor_parallel",
]

# TransformerConfig fields that switch off megatron's fused paths (they need TE / apex / CUDA JIT),
# so every module goes through the layer spec we build.
UNFUSED = dict(
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
)

# The MLP calls ``submodules.activation_func`` (a module built with ``config=``) on the whole fc1
# output only when this flag is set; the name says TE but the slot takes any module (0.16).
PLUGGABLE_ACTIVATION_FLAG = "use_te_activation_func"


def init_parallel(
    tp: int, pp: int, vpp: int, cp: int, optimizer_instances: int = 1, timeout_s: float | None = None
) -> None:
    """``optimizer_instances`` > 1: the distributed optimizer shards within groups of DP / instances
    ranks and is replicated across the instances (HSDP-like: dp_replicate × dp_shard). ``timeout_s``:
    the collective timeout of the groups megatron creates (it takes minutes)."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=cp,
        num_distributed_optimizer_instances=optimizer_instances,
        **({"distributed_timeout_minutes": timeout_s / 60} if timeout_s else {}),
    )


def destroy_parallel() -> None:
    parallel_state.destroy_model_parallel()


def seed(seed_: int) -> None:
    tensor_parallel.model_parallel_cuda_manual_seed(seed_)


def stage(vp_stage: int | None) -> tuple[bool, bool]:
    """(is first pipeline stage, is last pipeline stage) for a model chunk."""
    return (
        parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
    )


def ranks() -> dict[str, int]:
    ps = parallel_state
    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "dp_size": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_rank(),
    }


def gpt_model(
    config: TransformerConfig,
    block_spec: Any,
    *,
    vocab_size: int,
    max_seq: int,
    tied: bool,
    rope_theta: float,
    rope_scaling: Any,
    vp_stage: int | None,
) -> GPTModel:
    """GPTModel with RoPE; Llama-3 scaling through megatron's own ``rope_scaling`` arguments (0.16
    exposes only the factor; the other three llama3 constants are re-applied when they differ)."""
    first, last = stage(vp_stage)
    llama3 = rope_scaling is not None and rope_scaling.type == "llama3"
    linear = rope_scaling is not None and rope_scaling.type == "linear"
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_seq,
        pre_process=first,
        post_process=last,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_base=int(rope_theta) if float(rope_theta).is_integer() else rope_theta,
        rope_scaling=llama3,
        rope_scaling_factor=rope_scaling.factor if llama3 else 8.0,
        seq_len_interpolation_factor=rope_scaling.factor if linear else None,
        vp_stage=vp_stage,
    )
    if llama3 and (
        rope_scaling.low_freq_factor,
        rope_scaling.high_freq_factor,
        rope_scaling.original_max_position_embeddings,
    ) != (1.0, 4.0, 8192):
        rot = model.rotary_pos_emb
        dim = config.kv_channels
        base = 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rot.inv_freq.device) / dim))
        rot.inv_freq = rot._apply_scaling(
            base,
            factor=rope_scaling.factor,
            low_freq_factor=rope_scaling.low_freq_factor,
            high_freq_factor=rope_scaling.high_freq_factor,
            original_max_position_embeddings=rope_scaling.original_max_position_embeddings,
        )
    return model


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


def model_sharded_state_dict(chunk: Any) -> dict:
    return chunk.sharded_state_dict()


def optimizer_sharded_state_dict(optimizer: Any, model_sd: dict, is_loading: bool) -> dict:
    # dp_reshardable: the distributed optimizer's state can be loaded at another DP size.
    return optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
    )


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
