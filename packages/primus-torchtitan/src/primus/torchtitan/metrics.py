"""torchtitan's MetricsProcessor, kept silent: core's loop (:mod:`primus.core.run.loop`) reports every metric.

torchtitan's Trainer still builds a metrics processor (its batch generator counts tokens and data-loading time
on it); this one never logs, so torchtitan neither prints its own line nor computes its end-of-step loss
reductions.
"""

from __future__ import annotations

from typing import Any

from primus.torchtitan import compat

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402


class SilentMetricsProcessor(MetricsProcessor):
    def should_log(self, step: int) -> bool:
        return False


def metrics_builder():
    """A TrainSpec ``build_metrics_processor_fn``."""

    def build(
        job_config: Any, parallel_dims: Any, model_args: Any = None, tag: str | None = None
    ) -> SilentMetricsProcessor:
        return SilentMetricsProcessor(job_config, parallel_dims)

    return build
