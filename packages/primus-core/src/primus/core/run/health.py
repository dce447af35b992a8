"""Training health, the same for every backend: non-finite loss or grad norm caught on its step, loss
spikes reported. Backends call :meth:`HealthMonitor.check` after computing the step's loss and grad norm
and before the optimizer update; ``"skip"`` means: drop this step's gradients, do not update."""

from __future__ import annotations

import logging
import math
from collections import deque
from datetime import timedelta

from primus.core.config.schema import HealthConfig
from primus.core.contracts.errors import UserError

log = logging.getLogger("primus.health")


class NonFiniteError(UserError, RuntimeError):
    """Raised on a NaN/Inf loss or grad norm when the run must stop."""


class HealthMonitor:
    def __init__(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        self.skipped = 0
        self.spikes = 0
        self._recent: deque[float] = deque(maxlen=cfg.spike_window)

    def check(self, step: int, loss: float, grad_norm: float | None = None) -> str:
        """``"ok"`` or ``"skip"``; raises :class:`NonFiniteError` when the run must stop."""
        bad = [name for name, v in (("loss", loss), ("grad norm", grad_norm)) if v is not None and not math.isfinite(v)]
        if bad:
            what = f"step {step}: non-finite {' and '.join(bad)} (loss {loss}, grad norm {grad_norm})"
            if self.cfg.on_nonfinite == "stop":
                raise NonFiniteError(what + "; stopping (train.health.on_nonfinite: stop)")
            self.skipped += 1
            if self.skipped > self.cfg.max_skipped_steps:
                raise NonFiniteError(
                    f"{what}; {self.skipped} steps skipped, more than "
                    f"train.health.max_skipped_steps ({self.cfg.max_skipped_steps})"
                )
            log.warning("%s; update skipped (%d so far)", what, self.skipped)
            return "skip"
        if len(self._recent) >= self._recent.maxlen // 2:
            mean = sum(self._recent) / len(self._recent)
            if loss > self.cfg.spike_factor * mean:
                self.spikes += 1
                log.warning(
                    "step %d: loss spike %.4f > %.1f × recent mean %.4f", step, loss, self.cfg.spike_factor, mean
                )
        self._recent.append(loss)
        return "ok"

    def metrics(self) -> dict[str, float]:
        return {"skipped_steps": float(self.skipped), "loss_spikes": float(self.spikes)}


def collective_timeout(cfg: HealthConfig) -> timedelta:
    """For ``init_process_group(timeout=...)``: a hung collective errors out after this long."""
    return timedelta(seconds=cfg.collective_timeout_s)
