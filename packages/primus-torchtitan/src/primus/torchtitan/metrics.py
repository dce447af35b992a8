"""torchtitan's MetricsProcessor, reporting through Primus's lifecycle hooks.

torchtitan calls ``log(step, loss, max_loss, grad_norm, extra)`` on every rank at each logging step;
this subclass turns that into ``ctx.step_end(step, metrics)`` with the metrics every Primus backend
reports (core's :class:`~primus.core.metrics.Throughput` does tokens/s, TFLOP/s and MFU the same way
for all of them). Core writes metrics.jsonl / TensorBoard / the console line on rank 0.
"""

from __future__ import annotations

from typing import Any

import torch

from primus.core.metrics import Throughput
from primus.core.protocols import RunContext
from primus.torchtitan import compat

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402


class PrimusMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config: Any, parallel_dims: Any, ctx: RunContext) -> None:
        super().__init__(job_config, parallel_dims)
        self.ctx = ctx
        self.dp_degree = parallel_dims.dp_replicate * parallel_dims.dp_shard
        self.throughput = Throughput(ctx.info.flops_per_token, parallel_dims.world_size, ctx.info.peak_flops)
        self.last: dict[str, float] = {}
        self.health: Any = None  # the trainer's HealthMonitor: skipped_steps and loss_spikes join the metrics

    def reset_clock(self) -> None:
        """Start the first interval at the first step (not at model build)."""
        self.throughput.reset()
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()

    def _loss_on_all_ranks(self, loss: Any) -> float:
        loss = torch.as_tensor(loss, dtype=torch.float32).reshape(()).detach()
        if self.parallel_dims.pp_enabled:
            # only the last pipeline stage has the loss (the others hold -1): take the max over the world
            on_gpu = torch.cuda.is_available()
            loss = loss.to(torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
            torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.MAX)
        return float(loss.item())

    def log(
        self,
        step: int,
        global_avg_loss: Any,
        global_max_loss: Any,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        extra = extra_metrics or {}
        # ntokens_since_last_log counts this rank's tokens; every data-parallel rank sees as many
        self.throughput.add(self.ntokens_since_last_log * self.dp_degree)
        metrics: dict[str, float] = {
            "loss": self._loss_on_all_ranks(global_avg_loss),
            "grad_norm": float(grad_norm),
            "lr": float(extra.get("lr", float("nan"))),
        }
        metrics.update(self.throughput.interval())
        metrics["memory_gib"] = self.device_memory_monitor.get_peak_stats().max_reserved_gib
        if self.health is not None:
            metrics.update(self.health.metrics())
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.device_memory_monitor.reset_peak_stats()
        self.last = metrics
        self.ctx.step_end(step, metrics)


def metrics_builder(ctx: RunContext):
    """A TrainSpec ``build_metrics_processor_fn`` that reports to ``ctx``."""

    def build(
        job_config: Any, parallel_dims: Any, model_args: Any = None, tag: str | None = None
    ) -> PrimusMetricsProcessor:
        return PrimusMetricsProcessor(job_config, parallel_dims, ctx)

    return build
