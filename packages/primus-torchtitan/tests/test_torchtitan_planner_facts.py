"""TorchTitan's facts as the planner finds them (``primus.torchtitan.planner_profile``, named by the backend's
``BackendSpec(planner=...)``): the state it keeps per parameter, what its selective recompute keeps, autocast without
FSDP, where it fuses the loss, and the layouts the planner picks with them. Core's own planner tests (primus-core's
tests/test_planner.py) run without this package, on profiles of their own."""

from __future__ import annotations

import pytest

from primus.core.config.presets import model_config
from primus.core.config.schema import ModelConfig
from primus.core.contracts.plugins import get_registry
from primus.core.planner import Cluster, KernelTerms, Layout, best, candidates, device, estimate, profile_of
from primus.core.planner.modelmath import count_params
from primus.torchtitan.planner_profile import PROFILE


def _model(name: str) -> ModelConfig:
    return model_config(name, get_registry())


def _plan(name, dev, nodes, seq):
    return best(candidates(_model(name), Cluster(device(dev), nodes, 8), seq, engine="torchtitan"))


def test_the_planner_finds_torchtitans_profile():
    assert profile_of("torchtitan") is PROFILE


def test_state_bytes_per_parameter():
    m = _model("qwen2.5-7b")
    p = count_params(m).total
    fsdp_tt = estimate(m, Layout("torchtitan", "fsdp", dp=8), 4096).parts
    ddp_tt = estimate(m, Layout("torchtitan", "ddp", dp=8), 4096).parts
    assert (fsdp_tt["weights"], fsdp_tt["optimizer"]) == (pytest.approx(4 * p / 8), pytest.approx(8 * p / 8))
    assert ddp_tt["optimizer"] == 8 * p  # TorchTitan's DDP has no distributed optimizer


def test_activation_memory_orders():
    m = _model("llama3.1-8b")
    tt = {
        rc: estimate(m, Layout("torchtitan", "fsdp", dp=8, recompute=rc), 8192).parts["activations"]
        for rc in ("none", "selective", "full")
    }
    assert tt["full"] < tt["selective"] < tt["none"]


def test_llama70b_one_node_is_fsdp_with_full_recompute():
    c = _plan("llama3.1-70b", "MI300X", 1, 8192)
    assert (c.layout.dp_mode, c.layout.dp, c.layout.tp, c.layout.recompute) == ("fsdp", 8, 1, "full")


def test_llama70b_on_8_nodes_recomputes_less():
    c = _plan("llama3.1-70b", "MI300X", 8, 8192)
    assert c.layout.dp_mode == "fsdp" and c.layout.recompute in ("none", "selective", "partial")


def test_torchtitan_8b_is_fsdp():
    c = _plan("llama3.1-8b", "H100", 1, 8192)
    assert c.layout.dp_mode == "fsdp" and c.layout.dp == 8


def test_without_fsdp_the_residual_stream_is_fp32():
    # TorchTitan without FSDP keeps an fp32 residual stream under autocast: more activation memory per layer
    m = _model("llama3.2-1b")
    tt = estimate(m, Layout("torchtitan", "ddp", dp=1), 4096).parts["activations"]
    fsdp = estimate(m, Layout("torchtitan", "fsdp", dp=8), 4096).parts["activations"]
    d = m.hidden_size
    assert tt - fsdp == pytest.approx(m.num_layers * 4096 * 2 * d * (4 - 2))


def test_fused_loss_memory_only_where_the_engine_fuses():
    """The fused linear + cross-entropy holds one chunk of logits; torchtitan uses it only without TP, PP or CP:
    elsewhere the full logits are counted."""
    m = _model("llama3.2-1b")

    def logits(fused, **dims):
        return estimate(
            m, Layout("torchtitan", "fsdp", dp=1, **dims), 4096, kernels=KernelTerms(fused_loss=fused)
        ).parts["logits"]

    full = logits(False)
    assert logits(True) < full / 4
    assert logits(True, pp=2) == logits(False, pp=2)
    assert logits(True, tp=2) == logits(False, tp=2)
