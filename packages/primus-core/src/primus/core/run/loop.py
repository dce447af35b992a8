"""Core's training loop: the one loop every engine runs under.

The path of one run, file by file::

    primus train CONFIG        primus/core/cli/train.py      the command's arguments
      start(...)               primus/core/launch/start.py   the launcher's checks; torchrun for several devices
        resolve(...)           primus/core/launch/resolve.py layer + validate the config, plan the layout
        run_rank(...)          primus/core/launch/rank.py    select kernels, RunInfo, the run folder, hooks
          fit(cfg, ctx, spec)  primus/core/run/loop.py       this module: steps, LR, health, metrics, checkpoints
            spec.engine(...)   <backend>/engine.py           the adapter: builds the engine's own objects, one step

A backend is an adapter (:class:`Engine`): it builds its engine's native objects from the resolved config and
answers a handful of calls: ``train_step`` (one optimizer step over the global batch of a step, at the learning
rate core hands it, with core's health gate between the gradient norm and the update), ``evaluate`` (forward only
over evaluation samples), ``save`` / ``load`` (its state into / from a folder core names), ``barrier`` and
``close``. Everything else is here, once:

- **steps**: 1-based; step ``n`` consumes global batch ``n`` (the data position is the step), so a resumed run
  continues with the next unseen batch;
- **learning rate**: :func:`primus.core.run.schedule.lr_at` of the applied-update count (a skipped step does not
  advance it);
- **health** (``train.health``): :class:`~primus.core.run.health.HealthMonitor` checks the step's global loss and
  grad norm before the update: stop raises, skip drops the update;
- **metrics** at each ``logging.interval`` and the last step (:data:`METRICS`: the same names and meanings from
  every engine), to the lifecycle hooks (console, metrics.jsonl, TensorBoard: core's run log);
- **checkpoints** (``checkpoint``): folders ``step_00000012`` under ``checkpoint.dir`` (default
  ``<output_dir>/checkpoints``), every ``interval`` steps and at the end, committed atomically
  (:func:`primus.core.run.checkpoints.atomic_save`), the newest ``keep_last`` kept; the loop's own state (step,
  applied updates) rides in the manifest. ``--resume`` / ``checkpoint.resume`` loads the newest complete one
  that verifies against the sizes and checksums its manifest records (a broken newer one is skipped with a warning
  naming its files; none verifying is refused), or warns and starts at step 0 when there is none (``auto`` says so
  quietly); a fresh run refuses a folder that holds checkpoints. Each manifest records what decides the data order
  (:mod:`primus.core.data.fingerprint`: each data source's size, time and sampled bytes, blend weights, seed, global
  batch, sequence length, holdout); a resume where any changed is refused naming it, old and new
  (``checkpoint.allow_data_change: true``: a warning instead; another global batch is always refused);
- **evaluation** (``eval``): every ``eval.interval`` steps and at the last step, the engine's forward-only loss over
  the evaluation samples (:mod:`primus.core.run.evaluation`), in that step's metrics row and the run's summary;
- **stopping early** (:mod:`primus.core.run.stop`): SIGTERM / SIGUSR1 or ``train.max_minutes``: the step finishes on
  every rank, a checkpoint is committed, the summary's status is ``preempted`` (exit code 75);
  ``checkpoint.resume: auto`` resumes when a complete checkpoint exists and starts fresh when none does;
- **profiling** (``profile``): :class:`~primus.core.profile.capture.StepProfiler` around the steps;
- **hooks**: ``primus_on_model_ready`` once the engine is built, ``primus_on_train_start`` once its state is
  loaded, per step and per logging interval during the run (``RunContext``); ``primus_on_train_end`` is the
  caller's (:func:`primus.core.launch.rank.run_rank`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primus.core.config.schema import PrimusConfig
from primus.core.contracts.engine import Engine, check_engine
from primus.core.contracts.engine import Gate as Gate  # the contract's old home: re-exported
from primus.core.contracts.engine import StepResult as StepResult
from primus.core.contracts.errors import UserError
from primus.core.run import checkpoints as ckpt
from primus.core.run import oom
from primus.core.run.faults import FaultInjection
from primus.core.run.health import HealthMonitor
from primus.core.run.metrics import Throughput, memory_gib
from primus.core.run.rundir import checkpoint_root
from primus.core.run.schedule import lr_at

if TYPE_CHECKING:
    from primus.core.contracts.engine import BackendSpec, RunContext

log = logging.getLogger("primus.loop")

NAMING = ckpt.NAMING

# What every engine reports at each logging step (runlog prints them; metrics.jsonl holds them all).
METRICS = {
    "loss": "mean token loss of the step's global batch (the same value on every rank)",
    "grad_norm": "global L2 norm of the gradients before clipping",
    "lr": "learning rate the step's update used",
    "tokens_per_s": "tokens of the whole job per second, over the logging interval",
    "tokens_per_s_per_device": "tokens_per_s / world size",
    "tflops_per_device": "model TFLOP/s per device (primus.core.planner.modelmath.flops_per_token)",
    "mfu": "tflops_per_device / the device's dense bf16 peak (absent where the peak is unknown, e.g. CPU)",
    "interval_s": "seconds since the previous logging step",
    "memory_gib": "peak memory held by tensors since the previous logging step (GPU: max_memory_allocated; "
    "CPU: the process's peak resident set)",
    "skipped_steps": "updates the health check has skipped so far",
    "loss_spikes": "loss spikes the health check has reported so far",
    # and for mixture-of-experts models, primus.core.run.expert_load.METRICS
}
# What an engine that trains multi-token prediction (model.mtp) reports beside them (Engine.interval_metrics)
MTP_METRICS = {
    "mtp_loss": "multi-token prediction: its cross-entropy before model.mtp.loss_scale, mean over its depths and the "
    "interval's micro-batches (loss stays the main model's)",
}


def _due(cfg: PrimusConfig, step: int) -> bool:
    c = cfg.checkpoint
    return c.enabled and ((c.interval and step % c.interval == 0) or step == cfg.train.steps)


class _Checkpoints:
    """The checkpoint policy: where, when, atomic commit, keep-last, resume."""

    def __init__(self, cfg: PrimusConfig, ctx: RunContext, backend: str) -> None:
        self.cfg, self.backend = cfg, backend
        self.engine: Engine | None = None  # set once built
        self.rank, self.world = ctx.info.rank, ctx.info.world_size
        self.root = checkpoint_root(cfg)
        self.faults = FaultInjection.from_extra(cfg.backend.extra)
        self.saved: Path | None = None
        self.data: dict[str, Any] | None = None  # the data order's fingerprint, recorded in each manifest

    def fingerprint_data(self) -> None:
        """This run's data fingerprint (:mod:`primus.core.data.fingerprint`), taken once the engine has read the data:
        by rank 0 (one reader of the files), handed to every rank so that each takes the same resume decision."""
        from primus.core.data.fingerprint import fingerprint

        self.data = self._from_rank0(lambda: fingerprint(self.cfg))

    def refuse_earlier_run(self) -> None:
        """A fresh run never writes over an earlier run's checkpoints (checked before the engine is built)."""
        found = ckpt.complete_checkpoints(self.root, NAMING)
        if found:
            raise UserError(
                f"{self.root} holds checkpoints of an earlier run (steps {[s for s, _ in found]}); pass --resume "
                "to continue from the newest, or use another logging.output_dir / checkpoint.dir"
            )

    def save_initial(self, folder: Path) -> None:
        """``train.save_initial``: the weights the run starts from, committed like a checkpoint (files recorded, the
        manifest last, ``weights_only``: what decided the weights). The same weights already there are kept (a run
        restarted before its first checkpoint); anything else there is refused, before it is touched."""
        origin = ckpt.weights_only(self.cfg)
        man = ckpt.read_manifest(folder)
        if man is not None and man.get("weights_only") == origin:
            log.info("train.save_initial: %s already holds this run's initial weights", folder)
            return
        if folder.exists():
            raise UserError(
                f"train.save_initial: {folder} exists; load it with train.init_from={folder}, or name a new folder"
            )
        man = {**ckpt.manifest(self.cfg, 0, self.engine.layout, self.engine.distributions), "weights_only": origin}
        ckpt.atomic_save(folder, man, self.rank, self.engine.save_weights, self.engine.barrier, self.world)
        log.info("saved the initial weights in %s (load them with train.init_from)", folder)

    def resume(self) -> tuple[int, int]:
        """Load the newest complete checkpoint that verifies: (step, applied updates); (0, 0) when there is none.
        A newer one that does not verify is skipped with a warning naming its files; when none verifies, a
        :class:`~primus.core.run.checkpoints.CheckpointBroken` names them (not a fresh start over them)."""
        found = self._agreed(ckpt.complete_checkpoints(self.root, NAMING))
        if not found:
            if self.rank == 0 and self.cfg.checkpoint.resume == "auto":
                log.info("checkpoint.resume auto: %s holds no complete checkpoint, starting at step 0", self.root)
            elif self.rank == 0:
                log.warning("resume asked for, but %s holds no complete checkpoint: starting at step 0", self.root)
            return 0, 0
        step, folder = ckpt.newest_verified(found, self._problems, warn=self.rank == 0)
        man = ckpt.check_compatible(folder, self.cfg, self.backend)
        if self.data is not None:
            allow = self.cfg.checkpoint.allow_data_change
            ckpt.check_data_order(folder, man, self.data, allow, warn=self.rank == 0)
        self.engine.load(folder)
        self.engine.barrier()
        if self.rank == 0:  # a run killed between a commit and its purge left one too many
            ckpt.purge(self.root, NAMING, self.cfg.checkpoint.keep_last)
        log.info("resumed from %s (step %d)", folder, step)
        return step, int(man.get("applied_steps", step))

    # Every rank must load the same step. The candidates are rank 0's listing; each rank checks every file's size
    # (a stat) and the checksums of its share of the files (reading a checkpoint once in all, not once per rank);
    # the ranks pool what they found, so each takes the same decision. Without a process group (one rank, or a
    # test), a rank checks every checksum itself: the same decision from the same files on a shared file system.
    def _problems(self, folder: Path) -> list[str]:
        if self.world == 1 or not self._distributed():
            return ckpt.verify(folder)
        import torch.distributed as dist

        pooled: list[list[str] | None] = [None] * self.world
        dist.all_gather_object(pooled, ckpt.verify(folder, share=(self.rank, self.world)))
        return sorted({p for found in pooled for p in found or []})

    def _agreed(self, found: list[tuple[int, Path]]) -> list[tuple[int, Path]]:
        if self.world == 1 or not self._distributed():
            return found
        import torch.distributed as dist

        box = [found]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _from_rank0(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` on rank 0, its result (or the error it raised) on every rank."""
        if self.world == 1 or not self._distributed():
            return compute()
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box = [(True, compute())]
            except Exception as exc:  # every rank raises it: none waits for a broadcast that never comes
                box = [(False, exc)]
        dist.broadcast_object_list(box, src=0)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    @staticmethod
    def _distributed() -> bool:
        try:
            import torch.distributed as dist
        except ImportError:
            return False
        return dist.is_available() and dist.is_initialized()

    def save(self, step: int, applied: int) -> None:
        man = ckpt.manifest(self.cfg, step, self.engine.layout, self.engine.distributions)
        man["applied_steps"] = applied
        if self.data is not None:
            man[ckpt.DATA_KEY] = self.data
        final = NAMING.folder(self.root, step)

        def write(tmp: Path) -> None:
            self.engine.save(tmp)
            self.faults.during_save(step, self.rank)

        ckpt.atomic_save(final, man, self.rank, write, self.engine.barrier, self.world)
        if self.rank == 0:
            ckpt.purge(self.root, NAMING, self.cfg.checkpoint.keep_last)
        log.info("saved checkpoint %s", final)
        self.saved = final


def fit(cfg: PrimusConfig, ctx: RunContext, spec: BackendSpec) -> dict[str, Any]:
    """Build ``spec``'s engine on this rank and train it for ``train.steps`` steps; returns the run's summary
    (``status`` ``preempted`` when a stop signal or ``train.max_minutes`` ended it early, after a checkpoint). Running
    out of memory raises :class:`~primus.core.run.oom.OutOfMemory` (one line, its own exit code)."""
    checkpoints = _Checkpoints(cfg, ctx, spec.dist or spec.name)

    def last() -> Path | None:
        found = ckpt.latest(checkpoints.root, NAMING)
        return found[1] if found else None

    where = oom.Where(ctx.info.device, last)
    with where.watch(ctx.info.rank):
        return _fit(cfg, ctx, spec, checkpoints, where)


def _fit(cfg: PrimusConfig, ctx: RunContext, spec: BackendSpec, checkpoints: _Checkpoints, where: oom.Where):
    from primus.core.profile.capture import StepProfiler
    from primus.core.run import evaluation
    from primus.core.run.stop import StopRequest

    t = cfg.train
    if cfg.checkpoint.enabled and not ctx.resume:
        checkpoints.refuse_earlier_run()
    eval_data = ctx.eval_samples if cfg.eval.interval else None
    trains: dict[str, Any] = {}  # what a LoRA run trains, whatever the engine (its start line, its summary's "lora")
    if t.lora is not None:
        from primus.core.hf.lora import counts, describe

        trains = dict(zip(("trainable_params", "total_params"), counts(cfg), strict=True))
        if ctx.info.rank == 0:
            log.info(describe(cfg))
    began, building = time.perf_counter(), time.time()
    engine: Engine = spec.load_engine()(cfg, ctx)
    try:
        offers = check_engine(engine, spec.name)
    except UserError:
        if callable(getattr(engine, "close", None)):
            engine.close()
        raise
    checkpoints.engine = engine
    try:
        ctx.model_ready(engine.model_parts)
        if t.save_initial and "save_weights" not in offers:
            raise UserError(f"train.save_initial: backend {spec.name!r}'s engine cannot write its weights alone")
        if cfg.checkpoint.enabled or ctx.resume:
            checkpoints.fingerprint_data()
        if eval_data is not None:
            evaluation.require_evaluate(engine, spec.name)
        start = applied = 0
        if ctx.resume:
            where.at("loading the checkpoint to resume")
            start, applied = checkpoints.resume()
        if t.save_initial and start == 0:
            checkpoints.save_initial(Path(t.save_initial))
        ctx.hooks.primus_on_train_start(config=cfg, info=ctx.info)

        expert_load = _expert_load(cfg, engine, ctx.info.device) if "expert_routers" in offers else None
        health = HealthMonitor(t.health)
        meter = Throughput(ctx.info.flops_per_token, ctx.info.world_size, ctx.info.peak_flops)
        default_tokens = int(t.global_batch_size) * t.seq_len
        last: dict[str, float] = {}
        evaluated: dict[str, float] = {}
        stopped: str | None = None
        startup: dict[str, float] = {}
        step = start
        with StepProfiler(cfg, ctx.info) as profiler, StopRequest(t.max_minutes, ctx.info.world_size) as stop:
            meter.reset()
            memory_gib(ctx.info.device, reset=True)
            for step in range(start + 1, t.steps + 1):
                lr = lr_at(applied + 1, t)

                def gate(loss: float, grad_norm: float | None, step: int = step) -> bool:
                    return health.check(step, loss, grad_norm) == "ok"

                where.at(f"at step {step}")
                checkpoints.faults.out_of_memory(step, ctx.info.rank)
                stepping = time.time()
                result = engine.train_step(step, lr, gate)
                if step == start + 1:
                    startup = _startup(building, stepping, time.time())
                applied += int(result.applied)
                profiler.step()
                ctx.train_step(step)
                meter.add(result.tokens or default_tokens)
                stopped = stop.agreed() if step < t.steps else None  # at the last step the run is done anyway
                evaluate_now = eval_data is not None and evaluation.due(cfg, step)
                row: dict[str, float] = {}
                if step % cfg.logging.interval == 0 or step == t.steps or stopped or evaluate_now:
                    row = {
                        "loss": result.loss,
                        "grad_norm": float(result.grad_norm if result.grad_norm is not None else 0.0),
                        "lr": lr,
                        **meter.interval(),
                        "memory_gib": memory_gib(ctx.info.device, reset=True),
                        **health.metrics(),
                        **(expert_load.metrics() if expert_load else {}),
                        **(engine.interval_metrics() if "interval_metrics" in offers else {}),
                    }
                if evaluate_now:
                    where.at(f"evaluating at step {step}")
                    evaluated = evaluation.evaluate(engine, eval_data, cfg.eval.batches)
                    row.update(evaluated)
                    evaluated = {"step": step, **evaluated}
                    meter.reset()  # the evaluation's time is not training throughput
                if row:
                    last = row
                    ctx.step_end(step, row)
                elif step == start + 1:  # the first step's line would wait for the first logging step
                    log.info(
                        "step %d/%d done %.1f s after the engine build began (start-up: %s); metrics every %d steps "
                        "(logging.interval)",
                        step, t.steps, time.perf_counter() - began, ", ".join(f"{k} {v}" for k, v in startup.items()),
                        cfg.logging.interval,
                    )  # fmt: skip
                if _due(cfg, step) or (stopped and cfg.checkpoint.enabled):
                    where.at(f"saving the step-{step} checkpoint")
                    checkpoints.save(step, applied)
                    meter.reset()  # the save's time is not training throughput
                if stopped:
                    log.warning("stopped at step %d (%s)%s", step, stopped, _saved(checkpoints))
                    break
        return {
            "status": "preempted" if stopped else "ok",
            **({"stop_reason": stopped} if stopped else {}),
            **({"startup": startup} if step > start else {}),
            "final_step": step,
            "start_step": start,
            "metrics": last,
            **({"eval": evaluated} if evaluated else {}),
            "kernels": dict(ctx.info.kernels),
            "checkpoint": str(checkpoints.saved) if checkpoints.saved else None,
            **health.metrics(),
            **(engine.summary if "summary" in offers else {}),
            **({"lora": trains} if trains else {}),
        }
    finally:
        engine.close()


def _startup(building: float, stepping: float, stepped: float) -> dict[str, float]:
    """Where a run's time to its first step went (seconds): the process's start to the engine build (imports, the
    config, the data checks, kernels; absent where the start is unknown), the build (the model, its initial weights,
    the optimizer, a checkpoint loaded), the first step (compilation, autotuning, the first kernels), and all of it."""
    from primus.core.run.metrics import process_started

    out = {"build_s": round(stepping - building, 2), "first_step_s": round(stepped - stepping, 2)}
    if (started := process_started()) is not None:
        out = {"to_build_s": round(building - started, 2), **out, "to_first_step_s": round(stepped - started, 2)}
    return out


def _expert_load(cfg: PrimusConfig, engine: Any, device: str) -> Any:
    """An :class:`~primus.core.run.expert_load.ExpertLoad` on the routers the engine names (``expert_routers()``)
    for an MoE model, else None."""
    if cfg.model.moe is None:
        return None
    from primus.core.run.expert_load import ExpertLoad

    e = cfg.model.moe
    top_k = e.experts_per_token if e.capacity_factor is not None else None  # tokens dropped: moe_dropped
    layers = cfg.model.num_layers + (cfg.model.mtp.layers if cfg.model.mtp is not None else 0)  # MTP's blocks after
    return ExpertLoad(engine.expert_routers(), layers, e.num_experts, "cuda" if device != "cpu" else "cpu", top_k)


def _saved(checkpoints: _Checkpoints) -> str:
    return f": checkpoint {checkpoints.saved}" if checkpoints.saved else ": checkpoint.enabled is false, nothing saved"


def evaluate_checkpoint(cfg: PrimusConfig, ctx: RunContext, spec: BackendSpec, folder: Path) -> dict[str, Any]:
    """``primus eval``: build ``spec``'s engine, load the checkpoint ``folder`` (any layout) and evaluate it."""
    from primus.core.run import evaluation

    samples = ctx.eval_samples
    if samples is None:
        raise UserError("primus eval needs evaluation data: set eval.holdout (as in training) or eval.source")
    # the checkpoint, or a root's newest, that verifies (sizes and checksums; every rank reads every file once)
    folder = ckpt.readable(folder, NAMING)
    man = ckpt.check_compatible(folder, cfg, spec.dist or spec.name)
    engine: Engine = spec.load_engine()(cfg, ctx)
    try:
        evaluation.require_evaluate(engine, spec.name)
        engine.load(folder)
        result = evaluation.evaluate(engine, samples, cfg.eval.batches)
        return {"checkpoint": str(folder), "step": man.get("step"), **result}
    finally:
        engine.close()
