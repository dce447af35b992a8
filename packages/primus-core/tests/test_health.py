"""Health checks: non-finite values caught on their step (stop or skip), loss spikes reported."""

from __future__ import annotations

import logging

import pytest

from primus.core.config.schema import HealthConfig
from primus.core.run.health import HealthMonitor, NonFiniteError, collective_timeout


def test_nan_stops_on_its_step():
    mon = HealthMonitor(HealthConfig())
    assert mon.check(1, 5.0, 1.0) == "ok"
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite loss \(loss nan"):
        mon.check(2, float("nan"), 1.0)


def test_inf_grad_norm_skips_until_limit():
    mon = HealthMonitor(HealthConfig(on_nonfinite="skip", max_skipped_steps=2))
    assert mon.check(1, 5.0, float("inf")) == "skip"
    assert mon.check(2, 5.0, 2.0) == "ok"
    assert mon.check(3, float("nan"), float("nan")) == "skip"
    assert mon.metrics()["skipped_steps"] == 2
    with pytest.raises(NonFiniteError, match="3 steps skipped, more than train.health.max_skipped_steps"):
        mon.check(4, 5.0, float("-inf"))


def test_loss_spike_warns(caplog):
    mon = HealthMonitor(HealthConfig(spike_factor=2.0, spike_window=4))
    with caplog.at_level(logging.WARNING, logger="primus.health"):
        for step, loss in enumerate([4.0, 3.9, 3.8, 3.7, 9.0, 3.6], 1):
            assert mon.check(step, loss) == "ok"
    assert mon.spikes == 1 and "step 5: loss spike 9.0000" in caplog.text


def test_collective_timeout():
    assert collective_timeout(HealthConfig(collective_timeout_s=30)).total_seconds() == 30
