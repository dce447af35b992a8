"""Core's auxiliary load-balancing losses (primus.core.run.balancing): Switch's ``E * sum_i f_i P_i`` over a routed
micro-batch or each sequence, its parts over ranks, and the device that puts a loss computed inside the model into
the backward pass. That megatron-core's own losses equal these is tests/test_moe_balancing_same_run.py's."""

from __future__ import annotations

import pytest
import torch

from primus.core.run.balancing import attach, balancing_scores, batch_loss, sequence_loss, switch_loss


def _logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def test_the_formula_by_hand():
    logits = _logits(6, 4)
    scores, routed = balancing_scores(logits, 2)
    assert torch.allclose(scores, torch.softmax(logits, -1)) and routed.sum(-1).tolist() == [2] * 6
    f = routed.sum(0) / (2 * 6)  # each expert's share of the 12 assignments
    p = scores.mean(0)
    assert float(batch_loss(scores, routed, 2)) == pytest.approx(float(4 * (f * p).sum()), rel=1e-6)


def test_an_even_load_gives_one_and_a_collapsed_one_gives_e_over_k():
    """Uniform scores with every expert taking its share: 1. Every token on the same k experts with all the score
    there: E / k (the largest value)."""
    even = torch.full((8, 4), 0.25)
    routed = torch.zeros(8, 4, dtype=torch.bool)
    for t in range(8):
        routed[t, [t % 4, (t + 1) % 4]] = True
    assert float(batch_loss(even, routed, 2)) == pytest.approx(1.0)
    collapsed = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 8)
    assert float(batch_loss(collapsed, collapsed > 0, 2)) == pytest.approx(4 / 2)


def test_sigmoid_scores_are_normalised_over_the_experts_and_choose_by_the_raw_scores():
    logits = _logits(5, 8)
    scores, routed = balancing_scores(logits, 3, "sigmoid")
    assert torch.allclose(scores.sum(-1), torch.ones(5))
    assert torch.equal(routed, torch.zeros_like(routed).scatter_(-1, logits.topk(3).indices, True))


def test_sequence_loss_is_the_mean_of_each_sequences_batch_loss():
    logits = _logits(3 * 16, 8)
    scores, routed = balancing_scores(logits, 2)
    per_sequence = [batch_loss(scores[i * 16 : (i + 1) * 16], routed[i * 16 : (i + 1) * 16], 2) for i in range(3)]
    assert float(sequence_loss(scores, routed, 2, 16)) == pytest.approx(float(sum(per_sequence) / 3), rel=1e-6)
    # not the batch's: a sequence's imbalance is its own
    assert float(sequence_loss(scores, routed, 2, 16)) != pytest.approx(float(batch_loss(scores, routed, 2)), rel=1e-3)


def test_parts_of_a_set_over_ranks_sum_to_the_sets_loss():
    """Context parallelism: each rank's scores, the whole set's counts and size; the ranks' losses add up."""
    scores, routed = balancing_scores(_logits(32, 8), 2)
    counts = routed.sum(0)
    parts = [switch_loss(scores[i : i + 8], counts, 2, tokens=32) for i in range(0, 32, 8)]
    assert float(sum(parts)) == pytest.approx(float(batch_loss(scores, routed, 2)), rel=1e-6)


def test_attach_puts_the_loss_times_scale_into_the_backward_pass():
    w = torch.randn(4, 8, requires_grad=True)
    x = torch.randn(16, 4)
    logits = x @ w
    scores, routed = balancing_scores(logits, 2)
    loss = batch_loss(scores, routed, 2)
    out = attach(logits, loss, 0.25)
    assert torch.equal(out, logits)
    (out.sum() * 0).backward()  # nothing from the caller's loss: the gradient is the attached loss's alone
    (expected,) = torch.autograd.grad(0.25 * batch_loss(*balancing_scores(x @ w, 2), 2), w)
    assert torch.allclose(w.grad, expected, rtol=1e-5, atol=1e-9) and float(expected.abs().max()) > 0
