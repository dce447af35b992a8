"""Core's weight-decay rule (primus.core.run.optimizer): matrices decayed, norm weights and biases not."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_a_group_splits_into_decayed_matrices_and_undecayed_vectors():
    from primus.core.run.optimizer import split_weight_decay, takes_weight_decay

    linear, norm, bias, experts = torch.zeros(4, 3), torch.ones(3), torch.zeros(4), torch.zeros(2, 3, 4)
    assert [takes_weight_decay(p) for p in (linear, norm, bias, experts)] == [True, False, False, True]
    groups = split_weight_decay([{"params": [linear, norm, experts, bias], "weight_decay": 0.1, "lr": 1.0}])
    assert [[id(p) for p in g["params"]] for g in groups] == [[id(linear), id(experts)], [id(norm), id(bias)]]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and all(g["lr"] == 1.0 for g in groups)
    only_vectors = split_weight_decay([{"params": [norm], "weight_decay": 0.1}])
    assert only_vectors == [{"params": [norm], "weight_decay": 0.0}]  # no empty decayed group
