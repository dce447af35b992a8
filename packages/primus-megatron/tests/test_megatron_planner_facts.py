"""Megatron-Core's facts as the planner finds them (``primus.megatron.planner_profile``, named by the backend's
``BackendSpec(planner=...)``): the state it keeps per parameter, what its selective recompute keeps, where it fuses
the loss, and the layouts the planner picks with them. Core's own planner tests (primus-core's
tests/test_planner.py) run without this package, on profiles of their own."""

from __future__ import annotations

import pytest

from primus.core.config.presets import model_config
from primus.core.config.schema import ModelConfig
from primus.core.contracts.plugins import get_registry
from primus.core.planner import Cluster, KernelTerms, Layout, best, candidates, device, estimate, profile_of
from primus.core.planner.modelmath import count_params
from primus.megatron.planner_profile import PROFILE


def _model(name: str) -> ModelConfig:
    return model_config(name, get_registry())


def _plan(name, dev, nodes, seq):
    return best(candidates(_model(name), Cluster(device(dev), nodes, 8), seq, engine="megatron"))


def test_the_planner_finds_megatrons_profile():
    assert profile_of("megatron") is PROFILE


def test_state_bytes_per_parameter():
    m = _model("qwen2.5-7b")
    p = count_params(m).total
    ddp = estimate(m, Layout("megatron", "ddp", dp=8), 4096).parts
    dist = estimate(m, Layout("megatron", "ddp_distopt", dp=8), 4096).parts
    assert (ddp["weights"], ddp["gradients"], ddp["optimizer"]) == (2 * p, 4 * p, 12 * p)
    assert dist["optimizer"] == pytest.approx(12 * p / 8) and dist["gradients"] == 4 * p


def test_activation_memory_orders():
    m = _model("llama3.1-8b")
    act = {
        rc: estimate(m, Layout("megatron", "ddp", dp=1, recompute=rc), 8192).parts["activations"]
        for rc in ("none", "selective", "full")
    }
    assert act["full"] < act["selective"] <= act["none"]  # megatron's selective drops only flash attention's (nothing)
    # Llama 8B at seq 8192, bf16, one sample: 2·s·(6d + 2·kv·c + 3f) bytes per layer
    assert act["none"] == pytest.approx(32 * 2 * 8192 * (6 * 4096 + 2 * 8 * 128 + 3 * 14336))


def test_qwen7b_on_8_gpus_is_data_parallel_with_distributed_optimizer():
    c = _plan("qwen2.5-7b", "MI300X", 1, 4096)
    assert (c.layout.dp_mode, c.layout.dp, c.layout.tp, c.layout.pp) == ("ddp_distopt", 8, 1, 1)
    assert c.layout.recompute == "none"


def test_llama405b_is_tp_pp_vpp():
    c = _plan("llama3.1-405b", "MI300X", 64, 8192)
    assert c.layout.tp > 1 and c.layout.pp > 1 and c.layout.vpp > 1 and c.layout.dp_mode == "ddp_distopt"


def test_fused_loss_memory_only_where_the_engine_fuses():
    """The fused linear + cross-entropy holds one chunk of logits; megatron uses it at tp 1, also under PP (on the
    last stage)."""
    m = _model("llama3.2-1b")

    def logits(fused, **dims):
        return estimate(m, Layout("megatron", "fsdp", dp=1, **dims), 4096, kernels=KernelTerms(fused_loss=fused)).parts[
            "logits"
        ]

    full = logits(False)
    assert logits(True) < full / 4 and logits(True, pp=2) < full / 4
