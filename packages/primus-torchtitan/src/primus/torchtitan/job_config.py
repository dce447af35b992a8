"""A Primus config as torchtitan 0.2.2's ``JobConfig``: the field mapping, ``backend.extra`` overrides, and
the names validation checks them against.

This module imports neither torch nor torchtitan at import (``primus config validate`` uses it through
:mod:`primus.torchtitan.validate`); torchtitan's ``JobConfig`` is imported only by the functions that
build one. Engine patches are in :mod:`primus.torchtitan.compat`, not here.
"""

from __future__ import annotations

from typing import Any

from primus.core.run.health import collective_timeout
from primus.torchtitan import faults

# Primus pipeline schedule names -> torch.distributed.pipelining names, as torchtitan 0.2.2 takes them.
PP_SCHEDULES = {
    "1f1b": "1F1B",
    "gpipe": "GPipe",
    "interleaved_1f1b": "Interleaved1F1B",
    "zero_bubble": "InterleavedZeroBubble",
}

# The sections of torchtitan 0.2.2's JobConfig: ``backend.extra`` may only name these (validation checks the
# section without importing torchtitan; fields are checked when the JobConfig is built). tests/test_job_config.py
# compares this with the installed JobConfig.
JOB_CONFIG_SECTIONS = frozenset(
    {
        "job",
        "profiling",
        "metrics",
        "model",
        "optimizer",
        "lr_scheduler",
        "training",
        "parallelism",
        "checkpoint",
        "activation_checkpoint",
        "compile",
        "quantize",
        "comm",
        "memory_estimation",
        "fault_tolerance",
        "experimental",
        "validation",
        "debug",
    }
)


def job_config_cls() -> type:
    """torchtitan's ``JobConfig`` class (imports torchtitan, with the CPU adaptations where they apply)."""
    from primus.torchtitan.compat import import_torchtitan

    import_torchtitan()
    from torchtitan.config import JobConfig

    return JobConfig


def new_job_config() -> Any:
    return job_config_cls()()


def job_config_fields() -> dict[str, set[str]]:
    """Section -> field names of torchtitan's JobConfig (for validating ``backend.extra``)."""
    import dataclasses

    jc = job_config_cls()
    out = {}
    for f in dataclasses.fields(jc):
        section = f.default_factory()  # type: ignore[misc]
        out[f.name] = {g.name for g in dataclasses.fields(section)}
    return out


def extra_value(extra: dict[str, Any], path: str, default: Any = None) -> Any:
    """The value ``backend.extra`` gives a JobConfig field, written nested or dotted."""
    if path in extra:
        return extra[path]
    head, _, rest = path.partition(".")
    if rest and isinstance(extra.get(head), dict):
        return extra_value(extra[head], rest, default)
    return default


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


def llama3_fqns_per_stage(num_stages: int, num_layers: int) -> list[list[str]]:
    """Module names per pipeline stage for torchtitan's decoder models (``parallelism.module_fqns_per_model_part``):
    layers split as evenly as possible (earlier stages take the remainder), the embedding on the first stage,
    norm and output on the last."""
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
    par.expert_parallel_degree = p.ep
    # the experts tensor-parallel as the dense layers (megatron's default); ETP 1 lends the TP ranks to EP, whose
    # token split torchtitan 0.2.2 does not reduce in the backward (torchtitan#2387)
    par.expert_tensor_parallel_degree = p.tp
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
    return jc
