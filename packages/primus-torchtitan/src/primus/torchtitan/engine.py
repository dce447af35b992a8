"""The TorchTitan backend's adapter for core's training loop (:mod:`primus.core.run.loop`).

``build(cfg, ctx)`` makes torchtitan's own objects on this rank: a JobConfig from the Primus config
(:mod:`.job_config`), a TrainSpec holding the model args (flavor ``primus``), Primus's data loader and kernel
choices, and torchtitan's ``Trainer`` (:class:`~primus.torchtitan.trainer.PrimusTrainer`: its model code,
parallelize functions, pipeline schedules, optimizers and checkpointer), then the initial weights torchtitan's
config names (a seed checkpoint or a Hugging Face folder). :meth:`TorchTitanEngine.train_step` runs the
Trainer's own ``train_step`` at core's learning rate with core's health gate before the update; :meth:`save` /
:meth:`load` go through torchtitan's checkpointer (:mod:`.checkpoint`). Steps, the schedule, metrics,
checkpoint policy and resume are core's.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from pathlib import Path
from typing import Any

from primus.core.config.schema import PrimusConfig
from primus.core.contracts.engine import (
    Engine,
    Evaluates,
    IntervalMetrics,
    LoadsNative,
    RoutesExperts,
    RunContext,
    SavesWeights,
    StepResult,
    Summarises,
)
from primus.core.contracts.protocols import CONTEXT_PARALLEL
from primus.core.kernels.fp8_recipe import fp8_output_head
from primus.core.launch.env import free_port
from primus.core.run.rundir import checkpoint_root

log = logging.getLogger("primus.torchtitan")


def _single_process_env() -> None:
    """torchtitan initialises torch.distributed from the torchrun environment; provide it for one process."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def checkpoint_dir(cfg: PrimusConfig) -> Path:
    return checkpoint_root(cfg).absolute()


def kernel_plan(cfg: PrimusConfig, ctx: RunContext) -> dict[str, Any]:
    """op -> :class:`primus.torchtitan.kernels.Choice`: what this run swaps into torchtitan's model."""
    from primus.core.kernels.documents import masks_documents
    from primus.torchtitan import job_config
    from primus.torchtitan.kernels import plan

    loss_parallel = not job_config.extra_value(cfg.backend.extra, "parallelism.disable_loss_parallel", False)
    p = cfg.parallel
    choices = plan(
        ctx.kernels,
        family=cfg.model.family,
        tp=p.tp,
        cp=p.cp,
        pp=p.pp,
        loss_parallel=loss_parallel,
        fp8_head=fp8_output_head(cfg.kernels),
        documents=masks_documents(cfg),
    )
    if "fp8" in ctx.kernels:
        from primus.torchtitan import fp8

        choices["fp8"] = fp8.choice(cfg, ctx.kernels["fp8"])
    return choices


def build_trainer(cfg: PrimusConfig, ctx: RunContext, kernels: dict[str, Any] | None = None) -> Any:
    from primus.core.kernels.documents import document_eos
    from primus.torchtitan import compat
    from primus.torchtitan import job_config as jc

    device = ctx.info.device
    compat.import_torchtitan(device)

    from primus.torchtitan.data import dataloader_builder
    from primus.torchtitan.metrics import metrics_builder
    from primus.torchtitan.models import FLAVOR, engine_model, train_spec
    from primus.torchtitan.trainer import PrimusTrainer

    name = f"primus_{engine_model(cfg.model)}"
    spec = train_spec(
        cfg.model,
        cfg.train.seq_len,
        build_dataloader_fn=dataloader_builder(cfg),
        build_metrics_processor_fn=metrics_builder(),
        cpu=device == "cpu",
        kernels=kernels,
    )
    if cfg.train.lora is not None:  # the base frozen, adapters on its linears (primus.torchtitan.lora)
        from primus.torchtitan.lora import with_adapters

        spec = with_adapters(spec, cfg)
    compat.register_train_spec(name, spec)
    job_config = jc.build_job_config(
        cfg,
        model_name=name,
        flavor=FLAVOR,
        output_dir=ctx.info.output_dir,
        checkpoint_dir=str(checkpoint_dir(cfg)),
        gpu=device != "cpu",
    )
    trainer = PrimusTrainer(job_config)
    trainer.document_eos = document_eos(cfg)
    return trainer


# the engine contract and every optional capability (primus.core.contracts.engine), type-checked by nox -s lint
class TorchTitanEngine(Engine, Evaluates, RoutesExperts, IntervalMetrics, LoadsNative, SavesWeights, Summarises):
    def __init__(self, cfg: PrimusConfig, ctx: RunContext) -> None:
        from primus.torchtitan import compat, validate

        attention = ctx.kernels.get("attention")
        cp_attention = attention is not None and CONTEXT_PARALLEL in attention.features
        if ctx.info.device == "cpu" and (why := validate.cpu_refusal(cfg, cp_attention)):
            raise RuntimeError(f"the torchtitan backend cannot run this on a CPU: {why}")
        compat.import_torchtitan(ctx.info.device)
        from primus.torchtitan import checkpoint as ckpt

        self.cfg = cfg
        self.world_size = ctx.info.world_size
        if self.world_size == 1:
            _single_process_env()
        from primus.torchtitan import quiet

        quiet.install(cfg.logging.level, ctx.info.device)
        kernels = kernel_plan(cfg, ctx)
        if ctx.info.rank == 0:  # one line: what each op runs, ops of one outcome together
            outcomes: dict[str, list[str]] = {}
            for op, choice in kernels.items():
                what = ("swapped in" if choice.fn else "torchtitan module") + f" ({choice.note})"
                outcomes.setdefault(what, []).append(f"{op}={choice.provider}")
            log.info("torchtitan kernels: %s", "; ".join(f"{', '.join(ops)} → {o}" for o, ops in outcomes.items()))
        self.trainer = trainer = build_trainer(cfg, ctx, kernels)
        self.model_parts = trainer.model_parts
        self.layout = ckpt.layout(cfg, self.world_size)
        self.distributions = ckpt.DISTRIBUTIONS
        self.summary: dict[str, Any] = {
            "backend": "torchtitan",
            "kernels": {op: c.provider if c.fn else "torchtitan" for op, c in kernels.items()},
        }
        if cfg.train.init == "canonical":  # core's initial weights, the same on every layout and engine
            from primus.torchtitan.hf import init_canonical

            init_canonical(self.model_parts, cfg)
        if cfg.train.init_from:  # a Hugging Face folder or a torchtitan checkpoint (core converts a foreign one)
            from primus.torchtitan.hf import load_init_from

            load_init_from(trainer, cfg)
        self.frozen: frozenset[str] = frozenset()  # model keys checkpoints leave out: a LoRA run's frozen base
        if cfg.train.lora is not None:  # the adapters' starting values
            from primus.torchtitan import lora

            lora.setup(trainer, cfg)
            self.frozen = lora.base_keys(trainer.checkpointer)
        self.data = trainer.batch_generator(trainer.dataloader)
        from primus.torchtitan.balancing import Balancing, coefficients

        if coefficients(cfg):  # auxiliary-loss balancing: the routers' losses join the objective
            dims = trainer.parallel_dims
            cp_group = dims.get_mesh("cp").get_group() if dims.cp_enabled else None
            trainer.balancing = Balancing(cfg, self.expert_routers(), trainer.device, cp_group, dims.pp_enabled)

    def expert_routers(self) -> list[tuple[int, Any, Any]]:
        """torchtitan's routers on this rank (``layers.{i}.moe.router``: torchtitan keeps global layer names in
        every pipeline stage), with the tokens per expert from their output ``(scores, indices, counts)``."""
        from torchtitan.models.moe.moe import TokenChoiceTopKRouter

        return [
            (int(re.findall(r"layers\.(\d+)\.", name)[0]), m, lambda out: out[2])
            for part in self.model_parts
            for name, m in part.named_modules()
            if isinstance(m, TokenChoiceTopKRouter)
        ]

    def interval_metrics(self) -> dict[str, float]:
        """``moe_aux_loss`` / ``moe_seq_aux_loss`` (core's definitions, primus.core.run.expert_load.METRICS) over the
        steps since the last call, from the routers' hooks (:mod:`primus.torchtitan.balancing`)."""
        balancing = self.trainer.balancing
        return balancing.metrics() if balancing is not None else {}

    def train_step(self, step: int, lr: float, gate: Any) -> StepResult:
        trainer = self.trainer
        trainer.step = step
        trainer.gc_handler.run(step)
        trainer.set_lr(lr)
        trainer.gate = gate
        trainer.train_step(self.data)
        return StepResult(loss=trainer.last_loss, grad_norm=trainer.last_grad_norm, applied=not trainer.skipped)

    def evaluate(self, samples: Any, batches: int) -> float:
        from primus.torchtitan.data import PrimusDataLoader

        train = self.trainer.dataloader  # this rank's data-parallel slice, read the same way as training's
        loader = PrimusDataLoader(
            samples,
            dp_rank=train.dp_rank,
            dp_world_size=train.dp_world_size,
            batch_size=train.batch_size,
            global_batch_size=train.global_batch_size,
            seed=0,  # read in order: no shuffle
            shuffle=False,
        )
        per_batch = train.local_batch // train.batch_size
        return self.trainer.evaluate(itertools.islice(iter(loader), batches * per_batch))

    def save(self, folder: Path) -> None:
        from primus.torchtitan import checkpoint as ckpt

        ckpt.write(self.trainer.checkpointer, folder, leave_out=self.frozen)

    def load(self, folder: Path) -> None:
        from primus.torchtitan import checkpoint as ckpt

        ckpt.read(self.trainer.checkpointer, folder, leave_out=self.frozen)

    def load_native(self, found: Any, weights_only: bool) -> None:
        """A checkpoint plain TorchTitan wrote (``primus checkpoint import --from``; :mod:`primus.torchtitan.native`
        recognised it): the model, unless ``weights_only`` the optimizer, LR-scheduler and train state it holds
        (:func:`primus.torchtitan.checkpoint.load_native`). The data position is Primus's own at the source's step,
        as a Primus run of this config has it there: the source's data loader read its own data set."""
        from primus.torchtitan import checkpoint as ckpt

        ckpt.load_native(self.trainer, found, self.cfg, weights_only)
        self.trainer.step = found.step
        loader = self.trainer.dataloader
        loader.load_state_dict({"samples_consumed": found.step * loader.global_batch_size})

    def save_weights(self, folder: Path) -> None:
        from primus.torchtitan import checkpoint as ckpt

        ckpt.write_model(self.trainer.checkpointer, folder)

    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        import torch.distributed as dist

        self.trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def build(cfg: PrimusConfig, ctx: RunContext) -> TorchTitanEngine:
    return TorchTitanEngine(cfg, ctx)
