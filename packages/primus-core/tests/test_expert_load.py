"""Core's expert-load metrics from routers' forward hooks (primus.core.expert_load), on stand-in routers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from primus.core.expert_load import ExpertLoad  # noqa: E402


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
