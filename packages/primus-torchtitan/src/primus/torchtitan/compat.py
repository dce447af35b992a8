"""Every patch primus-torchtitan makes on torchtitan 0.2.2, and the version check and CPU import they need.

A patch is a last resort: one small named function per engine behaviour, listed in :data:`PATCHES` (below)
with what it replaces, why, and the test that fails when torchtitan changes under it. The table also lists
the engine methods Primus overrides or calls privately elsewhere in the package (trainer, checkpoint, metrics,
kernels, dense, hf, models), so this is the one place to re-check when the pin moves. Config translation is
not here: the JobConfig mapping is :mod:`primus.torchtitan.job_config`, the refusals :mod:`primus.torchtitan.validate`.

Kept here though not patches: :func:`check_version` and :func:`import_torchtitan` (which applies the CPU
patches before torchtitan's first import).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import resource
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from typing import Any

import torch

from primus.core.contracts.patches import Patch

log = logging.getLogger("primus.torchtitan")

TORCHTITAN_VERSION = "0.2.2"


PATCHES: tuple[Patch, ...] = (
    Patch(
        "compat.cpu_device_detection (CpuDeviceModule)",
        "torch._utils._get_available_device_type / _get_device_module while torchtitan.tools.utils is first "
        "imported (CPU only)",
        'torchtitan picks its device once at import (`_get_available_device_type() or "cuda"`) and four modules '
        'copy the name: a CPU build would get "cuda"',
        "test_compat.py::test_device_detection_still_falls_back_to_cuda, "
        "test_compat.py::test_cpu_device_reaches_every_module_that_copies_it",
    ),
    Patch(
        "compat.install_triton_standin",
        "sys.modules['torchtitan.models.moe.kernels'] (CPU without triton)",
        "that module imports triton at import and is reached from `import torchtitan`; dense models never call it",
        "test_compat.py::test_moe_kernels_still_import_triton",
    ),
    Patch(
        "compat.defer_hf_datasets",
        "sys.modules['torchtitan.hf_datasets.text_datasets'] (every device): a stand-in whose two builders, the "
        "names torchtitan's modules import from it (HF_DATASETS_NAMES), import the real module when called",
        "that module imports Hugging Face datasets (and with it pandas, pyarrow: 1.9 s of a rank's start on an H100) "
        "and is reached from torchtitan.train and every model's train spec; Primus builds its own data loader",
        "test_compat.py::test_hf_datasets_builders_are_all_torchtitan_imports, "
        "test_compat.py::test_a_rank_imports_no_hf_datasets",
    ),
    Patch(
        "compat.integer_histc_on_cpu",
        "torch.histc, on CPU for integer inputs (applied by import_torchtitan on CPU)",
        "the MoE router counts tokens per expert with torch.histc of the expert indices (int64); CUDA counts "
        "integers, torch's CPU kernel only floating types",
        "test_compat.py::test_moe_router_still_counts_integer_indices_with_histc",
    ),
    Patch(
        "compat.moe_permute_on_cpu",
        "torchtitan.models.moe.utils.generate_permute_indices (CPU only): its own use_cpu=True path",
        "expert parallelism orders the received tokens by expert with a Triton kernel unless told use_cpu; "
        "torchtitan never tells it on a CPU device",
        "test_compat.py::test_moe_permute_still_has_a_cpu_path",
    ),
    Patch(
        "compat.gloo_parallelize (force_sum_reduction)",
        "the TrainSpec's parallelize_fn, wrapped on CPU: FSDP modules reduce with SUM",
        "torchtitan sets FSDP's gradient divide factor to 1, which torch reduces with PREMUL_SUM; gloo has none",
        "test_compat.py::test_fsdp_without_divide_factor_uses_premul_sum_unless_forced",
    ),
    Patch(
        "compat.tied_embedding_fsdp_group",
        "torchtitan.models.llama3.infra.parallelize.fully_shard, while a tied dense model is parallelized",
        "llama3's apply_fsdp shards tok_embeddings and [norm, output] as two FSDP groups; torch refuses a tied "
        "weight in two groups",
        "test_compat.py::test_tied_embedding_fully_shard_patch",
    ),
    Patch(
        "compat.register_train_spec",
        "torchtitan.protocols.train_spec._extra_train_specs (private dict): the name popped before registering",
        "register_train_spec refuses a name already registered; one process may register a run's TrainSpec again",
        "test_compat.py::test_register_train_spec_replaces_through_the_private_dict",
    ),
    Patch(
        "compat.grad_norm_recorder",
        "torchtitan.distributed.utils.clip_grad_norm_, during one PrimusTrainer.train_step",
        "train_step clips and steps the optimizer in one method; the health check needs the norm before the update",
        "test_compat.py::test_train_step_still_clips_then_steps_the_optimizer_and_schedule",
    ),
    Patch(
        "compat.pp_grad_scale, compat.ddp_grad_scale, compat.rescale_grads (applied by "
        "PrimusTrainer.forward_backward_step)",
        "the gradients after a step's last micro-batch, before torchtitan clips them",
        "pipelines backpropagate the summed token loss (torchtitan#2972); DDP averages a loss already divided by "
        "the global token count (torchtitan#2318): gradients, clipping and grad norm would depend on the layout",
        "test_compat.py::test_pipeline_still_backpropagates_the_summed_loss, "
        "test_compat.py::test_ddp_still_averages_over_replicas",
    ),
    Patch(
        "trainer.PrimusTrainer.forward_backward_step",
        "override of Trainer.forward_backward_step (same keyword-only signature, calls super)",
        "hands the labels to a fused output head, records the micro-batch loss for the health check, sets the "
        "auxiliary balancing losses' gradient scale for the layout, applies the gradient-scale correction after the "
        "step's last micro-batch",
        "test_compat.py::test_trainer_overrides_keep_torchtitans_signatures",
    ),
    Patch(
        "trainer.PrimusTrainer.train_step",
        "override of Trainer.train_step (calls super); core's loop calls it once per step instead of Trainer.train",
        "the step runs under grad_norm_recorder, so core's health gate sees the loss and grad norm before the update",
        "test_compat.py::test_trainer_overrides_keep_torchtitans_signatures, "
        "test_compat.py::test_train_step_still_clips_then_steps_the_optimizer_and_schedule",
    ),
    Patch(
        "trainer.PrimusTrainer.maybe_enable_amp",
        "the instance attribute Trainer.__init__ sets (dist_utils.maybe_enable_amp), nullcontext() for fp32",
        "without FSDP/TP/PP torchtitan autocasts to mixed_precision_param even when it is float32 (warns, no effect)",
        "test_compat.py::test_maybe_enable_amp_is_an_attribute_built_once",
    ),
    Patch(
        "trainer.PrimusTrainer.__init__ (optimizers.step, lr_schedulers.step), trainer.PrimusTrainer.set_lr, "
        "trainer.exempt_from_weight_decay",
        "the step methods of torchtitan's optimizer and LR-scheduler containers, replaced per instance; the lr "
        "of each optimizer's param groups; each optimizer's one param group split in two (1-D params: no decay)",
        "a step the health gate refuses applies no update; the learning rate is core's (primus.core.run.schedule), "
        "set before each step, so torchtitan's schedulers never step; norms and biases take no weight decay, "
        "as in Megatron-Core",
        "test_compat.py::test_train_step_still_clips_then_steps_the_optimizer_and_schedule",
    ),
    Patch(
        "checkpoint.write, checkpoint.read, checkpoint.write_model, checkpoint.load_model, checkpoint.load_native",
        "CheckpointManager.dcp_save / dcp_load called directly, with the private _flattened_model_states_sd "
        "and _states_to_load; load_native reads plain torchtitan's checkpoints by their layout (native.py: the "
        "step-N names and completeness rule of _find_load_step, the model flattened to the top level, the other "
        "states under their names, the optimizer flattened per parameter)",
        "core names the folder and commits it; torchtitan has no public call that saves or loads a given folder, "
        "nor one that reads its own checkpoint's parts into another trainer",
        "test_checkpoint.py::test_checkpointer_calls_keep_torchtitans_signatures, "
        "test_checkpoint.py::test_native_format_is_still_torchtitans",
    ),
    Patch(
        "metrics.SilentMetricsProcessor.should_log",
        "override of MetricsProcessor.should_log (always False)",
        "core's loop reports every metric; torchtitan's train_step returns before its own loss reductions and log",
        "test_compat.py::test_metrics_processor_override_keeps_should_log",
    ),
    Patch(
        "kernels.swap_modules, loss.fuse_output",
        "module instances retyped: nn.RMSNorm, ScaledDotProductAttentionWrapper.forward, llama3/qwen3 "
        "FeedForward.forward, the output nn.Linear (FusedOutput)",
        "the selected kernel providers run inside torchtitan's own modules (same parameters, names, TP plans, "
        "FSDP groups)",
        "test_compat.py::test_ops_the_kernel_swap_retypes_are_still_torchtitans",
    ),
    Patch(
        "kernels.ProviderMoE",
        "MoE.forward overridden (same router, reorderer, experts and shared-experts calls)",
        "the moe_permute provider gathers the tokens into the experts' order and combines the outputs back, which "
        "torchtitan's forward does inline with indexing, a scatter and a batched product",
        "test_compat.py::test_moe_forward_still_gathers_and_combines_inline",
    ),
    Patch(
        "kernels.ProviderRouter",
        "TokenChoiceTopKRouter.forward overridden (its gate, options and return values kept)",
        "the moe_router provider computes the scores, top-k and weights after the gate in one call",
        "test_compat.py::test_router_forward_still_scores_chooses_and_weighs_as_the_provider_contract",
    ),
    Patch(
        "dense.DenseTransformer",
        "subclass of llama3's Transformer: __init__ and init_weights overridden",
        "qkv bias and tied embeddings, which llama3 lacks; init_weights ties again after to_empty",
        "test_compat.py::test_dense_model_overrides_keep_signatures",
    ),
    Patch(
        "state_dict.DenseStateDictAdapter",
        "subclass of Llama3StateDictAdapter: to_hf / from_hf overridden; its private _permute, _reverse_permute "
        "and from_hf_map used",
        "q/k/v biases (permuted like their weights) and tied embeddings in the Hugging Face mapping",
        "test_compat.py::test_dense_state_dict_adapter_relies_on_llama3s_helpers",
    ),
    Patch(
        "compat.router_gate_partial_grad (moe_parallelize, _router_gate_parallel)",
        "torchtitan.models.llama4.infra.parallelize.NoParallel (its router-gate style), while a MoE model is "
        "parallelized",
        "under TP, the routed experts' output is a partial sum over the TP ranks, and so is the gradient of the "
        "router scores that weight it (score_before_experts=False, qwen3's); 0.2.2 marks it replicated, so the "
        "router's gradient misses the other ranks' part and the gate weights part across ranks (torchtitan#2387, "
        "fixed after 0.2.2 by #2416, whose fix this is)",
        "test_compat.py::test_router_gate_style_still_marks_its_output_gradient_replicated",
    ),
    Patch(
        "balancing.Balancing (its forward hook on each router's gate)",
        "no engine attribute: a forward hook on TokenChoiceTopKRouter.gate (torchtitan's nn.Linear), registered after "
        "the model is parallelized, returning the gate's logits with the auxiliary losses attached",
        "torchtitan 0.2.2's MoE has no auxiliary loss; its router scores what the gate returns (under TP a local "
        "tensor, its gradient summed over TP: router_gate_partial_grad), so the losses see the router's logits and "
        "their gradient reaches the gate in every layout",
        "test_compat.py::test_router_scores_what_its_gate_returns",
    ),
    Patch(
        "state_dict.Qwen3SharedExpertsStateDictAdapter",
        "subclass of Qwen3StateDictAdapter: entries added to its from_hf_map",
        "shared experts (core's DeepSeek-style names) in the HF mapping that canonical init goes through",
        "test_compat.py::test_qwen3_adapter_maps_layer_keys_through_from_hf_map",
    ),
    Patch(
        "models.train_spec (qwen3 pipelining_fn)",
        "the qwen3 TrainSpec's pipelining_fn, set to torchtitan's pipeline_llm",
        "0.2.2 registers no pipeline split for qwen3; its decoder has llama3's module layout",
        "test_compat.py::test_qwen3_still_has_no_pipelining_fn",
    ),
)


def check_version() -> None:
    found = version("torchtitan")
    if found != TORCHTITAN_VERSION:
        raise RuntimeError(f"primus-torchtitan is written against torchtitan {TORCHTITAN_VERSION}, found {found}")


# ------------------------------------------------------------------------------------------------ CPU


class CpuDeviceModule(types.SimpleNamespace):
    """What torchtitan asks of ``torch.<device>`` (memory stats, name, properties), answered for the CPU.

    Peak "device" memory is the process's peak resident set size, the closest CPU analogue.
    """

    @staticmethod
    def _peak_rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux

    def __init__(self) -> None:
        super().__init__()
        self.memory = types.SimpleNamespace(_record_memory_history=lambda *a, **k: None, _snapshot=lambda: {})

    def set_device(self, device: Any) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="cpu", total_memory=total)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        peak = self._peak_rss()
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0, "num_ooms": 0}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass  # the kernel's peak RSS cannot be reset; it stays the run's peak

    def empty_cache(self) -> None:
        pass

    def synchronize(self, device: Any = None) -> None:
        pass

    def set_stream(self, stream: Any) -> None:
        pass


def install_triton_standin() -> bool:
    """``torchtitan/models/moe/kernels.py`` imports triton at import time and is reached from ``import
    torchtitan``; dense models never call it. Without triton (CPU machines), register a stand-in module
    whose functions refuse loudly. Returns whether the stand-in was installed."""
    name = "torchtitan.models.moe.kernels"
    if importlib.util.find_spec("triton") is not None or name in sys.modules:
        return False

    def _needs_triton(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("MoE token permutation needs triton, which is not installed")

    standin = types.ModuleType(name)
    standin.__doc__ = "primus-torchtitan stand-in: triton is not installed"
    standin.generate_permute_indices = _needs_triton
    standin.fill_indices_wrapper = _needs_triton
    sys.modules[name] = standin
    return True


HF_DATASETS = "torchtitan.hf_datasets.text_datasets"
#: what torchtitan 0.2.2's modules import from it (components.validate, the models' train specs)
HF_DATASETS_NAMES = ("build_text_dataloader", "build_text_validation_dataloader")


def defer_hf_datasets() -> bool:
    """Put off importing torchtitan's Hugging Face text datasets (and so ``datasets``, pandas, pyarrow) until one of
    its builders is called: a stand-in module whose :data:`HF_DATASETS_NAMES` import the real module and call it, and
    whose other names import it too. Returns whether the stand-in was installed (not where the module is already
    imported)."""
    if HF_DATASETS in sys.modules:
        return False

    def real() -> types.ModuleType:
        if sys.modules.get(HF_DATASETS) is standin:
            del sys.modules[HF_DATASETS]
        return importlib.import_module(HF_DATASETS)

    class Deferred(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):  # what tools ask every module (inspect: __file__) is not a use
                raise AttributeError(name)
            return getattr(real(), name)

    def builder(name: str) -> Callable[..., Any]:
        def build(*args: Any, **kwargs: Any) -> Any:
            return getattr(real(), name)(*args, **kwargs)

        build.__name__ = build.__qualname__ = name
        return build

    standin = Deferred(HF_DATASETS, "primus-torchtitan stand-in: the real module is imported when first used")
    for name in HF_DATASETS_NAMES:
        setattr(standin, name, builder(name))
    sys.modules[HF_DATASETS] = standin
    return True


def integer_histc_on_cpu() -> None:
    """``torch.histc`` of an integer CPU tensor, counted through float64 (exact below 2**53) and returned in the
    input's dtype, as CUDA's kernel does; everything else goes to torch's own. Idempotent."""
    if getattr(torch.histc, "_primus_integer", False):
        return
    histc = torch.histc

    def patched(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, **kw: Any) -> torch.Tensor:
        if input.is_floating_point() or input.device.type != "cpu" or kw:
            return histc(input, bins=bins, min=min, max=max, **kw)
        return histc(input.double(), bins=bins, min=min, max=max).to(input.dtype)

    patched._primus_integer = True  # type: ignore[attr-defined]
    torch.histc = patched


def moe_permute_on_cpu() -> None:
    """Expert parallelism on CPU: torchtitan's token permutation with its CPU implementation (``use_cpu=True``)
    instead of the Triton kernel it calls by default."""
    import functools

    from torchtitan.models.moe import kernels
    from torchtitan.models.moe import utils as moe_utils

    if not isinstance(moe_utils.generate_permute_indices, functools.partial):
        moe_utils.generate_permute_indices = functools.partial(kernels.generate_permute_indices, use_cpu=True)


@contextmanager
def cpu_device_detection() -> Iterator[CpuDeviceModule]:
    """torchtitan 0.2.2 decides its device once, in ``torchtitan.tools.utils`` at import
    (``_get_available_device_type() or "cuda"``), and four modules copy that name at their import. On a
    CPU build it would pick "cuda". Answer "cpu" (with :class:`CpuDeviceModule`) while torchtitan is
    first imported."""
    import torch._utils as tu

    shim = CpuDeviceModule()
    orig_type, orig_module = tu._get_available_device_type, tu._get_device_module
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda device_type: shim if device_type == "cpu" else orig_module(device_type)
    try:
        yield shim
    finally:
        tu._get_available_device_type, tu._get_device_module = orig_type, orig_module


def import_torchtitan(device: str | None = None) -> str:
    """Import torchtitan for ``device`` ("cuda", "rocm" or "cpu"; default: this machine's) with the CPU
    adaptations where needed; returns the device type torchtitan uses. Call before any torchtitan import."""
    if device is None:
        from primus.core.kernels.selection import detect_device

        device = detect_device()
    check_version()
    defer_hf_datasets()
    if device != "cpu":
        import torchtitan.tools.utils as tt_utils

        return tt_utils.device_type
    install_triton_standin()
    integer_histc_on_cpu()
    if "torchtitan.tools.utils" in sys.modules:
        import torchtitan.tools.utils as tt_utils

        if tt_utils.device_type != "cpu":
            raise RuntimeError(
                "torchtitan was imported before primus.torchtitan could select the CPU; "
                "import primus.torchtitan.engine first"
            )
        return "cpu"
    with cpu_device_detection():
        import torchtitan.tools.utils as tt_utils
        import torchtitan.train  # noqa: F401  (imports every module that copies the device name)
    moe_permute_on_cpu()
    return tt_utils.device_type


def force_sum_reduction(model: torch.nn.Module) -> None:
    """FSDP2 reduce-scatters with ``ReduceOp.PREMUL_SUM`` when torchtitan sets its gradient divide factor
    to 1; gloo has no PREMUL_SUM. With a factor of 1 a plain SUM is the same reduction (torch's public
    ``set_force_sum_reduction_for_comms``)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def gloo_parallelize(parallelize_fn: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """Wrap a torchtitan parallelize function so FSDP modules reduce with SUM (for gloo)."""

    def parallelize(model: torch.nn.Module, parallel_dims: Any, job_config: Any) -> torch.nn.Module:
        model = parallelize_fn(model, parallel_dims, job_config)
        force_sum_reduction(model)
        return model

    return parallelize


@contextmanager
def tied_embedding_fsdp_group(model: torch.nn.Module) -> Iterator[None]:
    """torchtitan 0.2.2's llama3 ``apply_fsdp`` shards ``tok_embeddings`` and ``[norm, output]`` as two FSDP
    groups; torch refuses a parameter (a tied embedding) shared by two groups. While torchtitan's
    parallelize function runs, its ``fully_shard`` skips the embedding alone and adds it to the output
    head's group (tensor parallelism, applied before, has given the two modules separate parameters:
    they are tied again first)."""
    import torchtitan.models.llama3.infra.parallelize as llama3_parallelize

    original = llama3_parallelize.fully_shard

    def fully_shard(module: Any, **kwargs: Any) -> Any:
        if module is model.tok_embeddings:
            return module
        if isinstance(module, list) and any(m is model.output for m in module):
            model.output.weight = model.tok_embeddings.weight
            module = [model.tok_embeddings, *module]
        return original(module, **kwargs)

    llama3_parallelize.fully_shard = fully_shard
    try:
        yield
    finally:
        llama3_parallelize.fully_shard = original


def _router_gate_parallel() -> type:
    from torch.distributed.tensor import Partial
    from torchtitan.distributed import NoParallel

    class RouterGateParallel(NoParallel):
        """torchtitan's NoParallel for the router gate (weights replicated over TP, input all-gathered), whose local
        output takes its gradient as a partial sum: the DTensor backward then all-reduces it over TP."""

        @staticmethod
        def _prepare_output_fn(output_layout: Any, use_local_output: bool, mod: Any, outputs: Any, device_mesh: Any):
            if outputs.placements != (output_layout,):
                outputs = outputs.redistribute(placements=(output_layout,), async_op=True)
            return outputs.to_local(grad_placements=(Partial(),)) if use_local_output else outputs

    return RouterGateParallel


@contextmanager
def router_gate_partial_grad() -> Iterator[None]:
    """While torchtitan's MoE parallelize function (``apply_moe_ep_tp``, used by qwen3) runs, its router gate is
    parallelized with :func:`_router_gate_parallel`'s style: under TP the router scores weight the experts' partial
    output (Megatron's order, ``score_before_experts=False``), so their gradient is partial over TP."""
    import torchtitan.models.llama4.infra.parallelize as llama4_parallelize

    original = llama4_parallelize.NoParallel
    llama4_parallelize.NoParallel = _router_gate_parallel()
    try:
        yield
    finally:
        llama4_parallelize.NoParallel = original


def moe_parallelize(parallelize_fn: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """Wrap torchtitan's parallelize function of a MoE model in :func:`router_gate_partial_grad`."""

    def parallelize(model: torch.nn.Module, parallel_dims: Any, job_config: Any) -> torch.nn.Module:
        with router_gate_partial_grad():
            return parallelize_fn(model, parallel_dims, job_config)

    return parallelize


def register_train_spec(name: str, spec: Any) -> None:
    """Register (or, within one process, replace) a TrainSpec; 0.2.2 keeps them in a plain dict."""
    import torchtitan.protocols.train_spec as ts

    ts._extra_train_specs.pop(name, None)
    ts.register_train_spec(name, spec)


def rescale_grads(model_parts: list[torch.nn.Module], factor: float) -> None:
    """Multiply every gradient by ``factor`` (one foreach op per dtype/device group)."""
    grads = [p.grad for m in model_parts for p in m.parameters() if p.grad is not None]
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)


def pp_grad_scale(global_valid_tokens: float) -> float:
    """torchtitan 0.2.2 pipelines backpropagate the *summed* token loss (``scale_grads=False``, the loss
    divided by the global token count only afterwards; torchtitan#2972), so gradients, the clipping and
    the grad norm are ``global_valid_tokens`` times those of every other layout. Scale that back."""
    return 1.0 / float(global_valid_tokens)


def ddp_grad_scale(dp_replicate: int) -> float:
    """torchtitan 0.2.2's DDP (``replicate``) averages gradients over replicas on top of a loss already
    divided by the global token count (torchtitan#2318): gradients come out ``dp_replicate`` times too small."""
    return float(dp_replicate)


@contextmanager
def grad_norm_recorder(record: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """torchtitan 0.2.2's ``Trainer.train_step`` computes the grad norm (``dist_utils.clip_grad_norm_``)
    and steps the optimizer in one method, with no hook between. While one step runs, the clip function
    hands its norm to ``record`` (which may raise, or decide to skip the update) before returning."""
    import torchtitan.distributed.utils as dist_utils

    original = dist_utils.clip_grad_norm_

    def clip_grad_norm_(*args: Any, **kwargs: Any) -> torch.Tensor:
        norm = original(*args, **kwargs)
        record(norm)
        return norm

    dist_utils.clip_grad_norm_ = clip_grad_norm_
    try:
        yield
    finally:
        dist_utils.clip_grad_norm_ = original
