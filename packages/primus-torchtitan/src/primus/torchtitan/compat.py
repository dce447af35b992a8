"""Everything that depends on the exact torchtitan release (0.2.2): its import, its config object, its
registration API, and the few adaptations it needs on a CPU-only machine.

When the pin moves, this is the module to re-check; ``tests/test_compat.py`` fails if any assumption
below stops holding. Each adaptation is one small, named function, applied only where it is needed.
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

from primus.core.health import collective_timeout
from primus.torchtitan import faults

log = logging.getLogger("primus.torchtitan")

TORCHTITAN_VERSION = "0.2.2"

# Primus pipeline schedule names -> torch.distributed.pipelining names, as torchtitan 0.2.2 takes them.
PP_SCHEDULES = {
    "1f1b": "1F1B",
    "gpipe": "GPipe",
    "interleaved_1f1b": "Interleaved1F1B",
    "zero_bubble": "InterleavedZeroBubble",
}


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
        from primus.core.kernels import detect_device

        device = detect_device()
    check_version()
    if device != "cpu":
        import torchtitan.tools.utils as tt_utils

        return tt_utils.device_type
    install_triton_standin()
    if "torchtitan.tools.utils" in sys.modules:
        import torchtitan.tools.utils as tt_utils

        if tt_utils.device_type != "cpu":
            raise RuntimeError(
                "torchtitan was imported before primus.torchtitan could select the CPU; "
                "import primus.torchtitan.runner first"
            )
        return "cpu"
    with cpu_device_detection():
        import torchtitan.tools.utils as tt_utils
        import torchtitan.train  # noqa: F401  (imports every module that copies the device name)
    return tt_utils.device_type


def cpu_refusal(cfg: Any) -> str | None:
    """What cannot run on a CPU (gloo) with torch 2.13, though it runs on GPUs: torch registers no DTensor
    sharding rule for the CPU flash-attention op that SDPA picks, which context parallelism and qwen3's
    tensor parallelism (its attention runs on DTensors) reach."""
    p = cfg.parallel
    if p.cp > 1:
        return "parallel.cp > 1 needs a GPU: no DTensor sharding rule for CPU flash attention"
    if cfg.model.family == "qwen3" and p.tp > 1:
        return "qwen3 with parallel.tp > 1 needs a GPU: no DTensor sharding rule for CPU flash attention"
    return None


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


# ------------------------------------------------------------------------------------------------ engine API


def job_config_cls() -> type:
    from torchtitan.config import JobConfig

    return JobConfig


def new_job_config() -> Any:
    return job_config_cls()()


def apply_overrides(job_config: Any, extra: dict[str, Any], prefix: str = "") -> None:
    """Set ``backend.extra`` entries on the JobConfig: nested mappings (``{checkpoint: {folder: x}}``)
    or dotted keys (``"checkpoint.folder": x``) naming torchtitan's own config fields."""
    for key, value in extra.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            apply_overrides(job_config, value, prefix=f"{path}.")
            continue
        *parents, leaf = path.split(".")
        obj = job_config
        for part in parents:
            if not hasattr(obj, part):
                raise KeyError(f"backend.extra.{path}: torchtitan's JobConfig has no section {part!r}")
            obj = getattr(obj, part)
        if not hasattr(obj, leaf):
            raise KeyError(f"backend.extra.{path}: torchtitan's JobConfig has no field {leaf!r}")
        if isinstance(getattr(obj, leaf), str) and not isinstance(value, str):
            value = str(value)  # e.g. selective_ac_option: 2 from YAML or the command line
        setattr(obj, leaf, value)


def build_job_config(cfg: Any, *, model_name: str, flavor: str, output_dir: str, checkpoint_dir: str, gpu: bool) -> Any:
    """torchtitan's JobConfig for a validated, resolved Primus config (``backend.extra`` applied last)."""
    t, p, o = cfg.train, cfg.parallel, cfg.train.optimizer
    jc = new_job_config()
    jc.job.dump_folder = output_dir
    jc.job.description = cfg.description or cfg.model.name
    jc.model.name, jc.model.flavor = model_name, flavor

    jc.optimizer.name = {"adamw": "AdamW", "adam": "Adam"}[o.name]
    jc.optimizer.lr, jc.optimizer.eps, jc.optimizer.weight_decay = o.lr, o.eps, o.weight_decay
    jc.optimizer.beta1, jc.optimizer.beta2 = o.beta1, o.beta2
    jc.optimizer.implementation = "fused" if gpu else "foreach"
    jc.lr_scheduler.warmup_steps = t.schedule.warmup_steps
    jc.lr_scheduler.decay_type = "cosine" if t.schedule.decay == "constant" else t.schedule.decay
    jc.lr_scheduler.decay_ratio = 0.0 if t.schedule.decay == "constant" else None
    jc.lr_scheduler.min_lr_factor = o.min_lr / o.lr

    dp = p.dp_replicate * int(p.dp_shard)
    # torchtitan feeds a pipeline one local batch per step, cut into pp micro-batches; without pp it
    # accumulates gradients over local batches of micro_batch_size.
    local_batch = t.global_batch_size // dp if p.pp > 1 else t.micro_batch_size
    jc.training.local_batch_size, jc.training.global_batch_size = local_batch, t.global_batch_size
    jc.training.seq_len, jc.training.steps = t.seq_len, t.steps
    jc.training.max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
    jc.training.dtype = "float32"  # parameters and optimizer state stay fp32
    jc.training.mixed_precision_param = "bfloat16" if t.precision == "bf16" else "float32"
    jc.training.mixed_precision_reduce = "float32"

    par = jc.parallelism
    par.data_parallel_replicate_degree, par.data_parallel_shard_degree = p.dp_replicate, int(p.dp_shard)
    par.fsdp_reshard_after_forward = "default" if p.reshard_after_forward else "never"
    par.tensor_parallel_degree, par.context_parallel_degree = p.tp, p.cp
    par.pipeline_parallel_degree = p.pp
    if p.pp > 1:
        par.pipeline_parallel_schedule = PP_SCHEDULES[p.pp_schedule]
        par.pipeline_parallel_microbatch_size = t.micro_batch_size
        par.module_fqns_per_model_part = llama3_fqns_per_stage(p.pp * p.vpp, cfg.model.num_layers)

    ac = jc.activation_checkpoint
    ac.mode = p.recompute
    if p.recompute == "selective":
        # per-op SAC; backend.extra {activation_checkpoint: {selective_ac_option: N}} checkpoints every N-th layer
        ac.selective_ac_option = "op"
    jc.compile.enable = t.compile
    jc.compile.components = ["model", "loss"]

    ck = jc.checkpoint
    ck.enable = cfg.checkpoint.enabled
    ck.folder = checkpoint_dir  # absolute: os.path.join(dump_folder, folder) keeps it
    ck.interval = cfg.checkpoint.interval or t.steps
    ck.keep_latest_k = cfg.checkpoint.keep_last
    ck.last_save_model_only = False  # the final checkpoint must be resumable too
    ck.async_mode = "disabled"

    # a hung collective errors out after train.health.collective_timeout_s, at init and while training
    timeout = int(collective_timeout(t.health).total_seconds())
    jc.comm.init_timeout_seconds = jc.comm.train_timeout_seconds = timeout

    jc.metrics.log_freq = cfg.logging.interval
    jc.metrics.enable_tensorboard = False  # core's run log writes TensorBoard
    jc.metrics.disable_color_printing = True
    jc.debug.seed = t.seed
    # backend.extra.fault_injection is Primus's (primus.torchtitan.faults), not a JobConfig section
    apply_overrides(jc, {k: v for k, v in cfg.backend.extra.items() if k != faults.EXTRA_KEY})
    if not cfg.checkpoint.enabled and ck.initial_load_path:
        ck.enable, ck.load_only = True, True  # load the initial weights, save nothing
    return jc


@contextmanager
def checkpoint_manager_class(factory: Callable[..., Any]) -> Iterator[None]:
    """torchtitan 0.2.2's ``Trainer.__init__`` builds its checkpointer by calling the name
    ``CheckpointManager`` of ``torchtitan.train``; while it runs, that name is ``factory`` (which builds
    a subclass, :class:`primus.torchtitan.checkpoint.AtomicCheckpointManager`)."""
    import torchtitan.train as tt_train

    original = tt_train.CheckpointManager
    tt_train.CheckpointManager = factory
    try:
        yield
    finally:
        tt_train.CheckpointManager = original


def extra_value(extra: dict[str, Any], path: str, default: Any = None) -> Any:
    """The value ``backend.extra`` gives a JobConfig field, written nested or dotted."""
    if path in extra:
        return extra[path]
    head, _, rest = path.partition(".")
    if rest and isinstance(extra.get(head), dict):
        return extra_value(extra[head], rest, default)
    return default


def job_config_fields() -> dict[str, set[str]]:
    """Section -> field names of torchtitan's JobConfig (for validating ``backend.extra``)."""
    import dataclasses

    jc = job_config_cls()
    out = {}
    for f in dataclasses.fields(jc):
        section = f.default_factory()  # type: ignore[misc]
        out[f.name] = {g.name for g in dataclasses.fields(section)}
    return out


def register_train_spec(name: str, spec: Any) -> None:
    """Register (or, within one process, replace) a TrainSpec; 0.2.2 keeps them in a plain dict."""
    import torchtitan.protocols.train_spec as ts

    ts._extra_train_specs.pop(name, None)
    ts.register_train_spec(name, spec)


def llama3_fqns_per_stage(num_stages: int, num_layers: int) -> list[list[str]]:
    """Module names per pipeline stage for torchtitan's decoder models: layers split as evenly as possible
    (earlier stages take the remainder), the embedding on the first stage, norm and output on the last."""
    base, rem = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < rem else 0)
        names = [f"layers.{i}" for i in range(start, start + n)]
        start += n
        if s == 0:
            names.insert(0, "tok_embeddings")
        if s == num_stages - 1:
            names += ["norm", "output"]
        out.append(names)
    return out


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
