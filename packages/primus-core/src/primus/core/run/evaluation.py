"""Evaluation: the mean token loss of the model over evaluation samples, forward only.

The samples are ``eval.holdout`` of the training samples (never trained on) or those of ``eval.source``
(:mod:`primus.core.data.splits`); an evaluation reads the first ``eval.batches`` global batches of them, in order,
so every evaluation of a run, on any engine and layout, covers the same tokens. The engine runs the forward passes
(:meth:`primus.core.contracts.engine.CAPABILITIES`): no gradient, optimizer state or training data position is touched,
and the model is left as training left it (the parameters the optimizer holds: a checkpoint may follow at once).
"""

from __future__ import annotations

import math
import time
from typing import Any

from primus.core.config.schema import PrimusConfig
from primus.core.contracts.engine import capabilities
from primus.core.contracts.errors import UserError

# What an evaluation reports (in the metrics row of its step, the lifecycle hooks and the run's summary).
EVAL_METRICS = {
    "eval_loss": "mean token loss over the eval.batches global batches of evaluation samples",
    "eval_perplexity": "exp(eval_loss)",
    "eval_s": "seconds the evaluation took",
}


def evaluates(engine: Any) -> bool:

    return "evaluate" in capabilities(engine)


def require_evaluate(engine: Any, backend: str) -> None:
    if not evaluates(engine):
        raise UserError(
            f"backend {backend!r} does not evaluate (its engine has no evaluate): set eval.interval=0 "
            "or use a backend that does"
        )


def evaluate(engine: Any, samples: Any, batches: int) -> dict[str, float]:
    t0 = time.perf_counter()
    loss = float(engine.evaluate(samples, batches))
    return {
        "eval_loss": loss,
        "eval_perplexity": math.exp(loss) if loss < 700 else math.inf,
        "eval_s": time.perf_counter() - t0,
    }


def due(cfg: PrimusConfig, step: int) -> bool:
    n = cfg.eval.interval
    return bool(n) and (step % n == 0 or step == cfg.train.steps)
