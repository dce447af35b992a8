"""Core's expert-load metrics from routers' forward hooks (primus.core.run.expert_load), on stand-in routers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from primus.core.run.expert_load import ExpertLoad  # noqa: E402


class Router(torch.nn.Module):
    """Returns (scores, tokens per expert) as given, like an engine's router output."""

    def __init__(self, counts: list[float]) -> None:
        super().__init__()
        self.out = torch.tensor(counts)

    def forward(self, x):  # noqa: ANN001, ANN201
        return x, self.out


def test_busiest_and_idlest_expert_against_the_even_share_worst_layer():
    a, b = Router([4, 4, 4, 4]), Router([8, 4, 4, 0])  # layer 1 even, layer 3 uneven (layer 0, 2: dense)
    load = ExpertLoad([(1, a, lambda out: out[1]), (3, b, lambda out: out[1])], num_layers=4, num_experts=4,
                      device="cpu")  # fmt: skip
    for _ in range(2):  # two micro-batches in the interval
        a(torch.zeros(1)), b(torch.zeros(1))
    assert load.metrics() == {"moe_load_max": 2.0, "moe_load_min": 0.0}  # 16/8 and 0/8 in layer 3
    assert load.metrics() == {}  # a new interval: nothing routed yet
    a(torch.zeros(1))
    assert load.metrics() == {"moe_load_max": 1.0, "moe_load_min": 1.0}
    load.close()
    b(torch.zeros(1))
    assert load.metrics() == {}  # the hooks are gone


def test_dropped_share_counts_each_routers_tokens_times_top_k():
    """With a capacity (top_k given): 1 - routed / (input tokens × top-k), over every layer and router call."""
    a, b = Router([4, 4, 2, 0]), Router([3, 3, 3, 3])  # 10 and 12 routed of 6 tokens × top-2 each
    load = ExpertLoad([(0, a, lambda out: out[1]), (1, b, lambda out: out[1])], 2, 4, "cpu", top_k=2)
    a(torch.zeros(2, 3, 16)), b(torch.zeros(6, 16))  # [s, b, h] (megatron) and [tokens, h] (torchtitan): 6 tokens
    got = load.metrics()
    assert got["moe_dropped"] == pytest.approx(1 - 22 / 24, abs=1e-6) and got["moe_load_max"] == pytest.approx(1.6)
    plain = ExpertLoad([(0, a, lambda out: out[1])], 1, 4, "cpu")  # no capacity: nothing dropped to report
    a(torch.zeros(6, 16))
    assert set(plain.metrics()) == {"moe_load_max", "moe_load_min"}
