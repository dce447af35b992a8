"""Triton cross-entropy on plain logits against core's fp32 reference (``F.cross_entropy``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus.core.kernels import reference  # noqa: E402
from primus.turbo.triton import cross_entropy as kernels  # noqa: E402


def targets(shape, vocab, device, ignore_every: int = 0):
    t = torch.randint(0, vocab, shape, device=device)
    if ignore_every:
        t.view(-1)[::ignore_every] = -100
    return t


@pytest.mark.parametrize(
    ("shape", "vocab", "block", "dtype"),
    [
        ((2, 9), 1000, 256, torch.float32),  # 4 vocab blocks, the last one partial: the online logsumexp
        ((13,), 300, None, torch.float32),  # one block wider than the vocab
        ((3, 4), 777, 128, torch.bfloat16),
    ],
    ids=["blocks-of-256", "one-block", "bf16"],
)
def test_cross_entropy_matches_reference(device, assert_matches, shape, vocab, block, dtype):
    assert block is None or vocab % block
    torch.manual_seed(0)
    logits = (torch.randn(*shape, vocab, device=device) * 4).to(dtype).requires_grad_()
    logits_r = logits.detach().float().requires_grad_()
    target = targets(shape, vocab, device, ignore_every=5)

    loss = kernels.CrossEntropyFunction.apply(logits, target, -100, block)
    (3 * loss).backward()  # an upstream gradient other than 1
    ref = reference.cross_entropy(logits_r, target)
    (3 * ref).backward()

    assert loss.dtype == torch.float32 and logits.grad.dtype == dtype
    assert_matches(loss, ref)  # fp32 math on the same (rounded) logits: fp32 bounds for the loss
    assert_matches(logits.grad, logits_r.grad, dtype)
    assert not logits.grad.view(-1, vocab)[::5].any()  # ignored tokens get no gradient


def test_other_ignore_index_and_the_public_function(device, assert_matches):
    torch.manual_seed(1)
    logits = torch.randn(6, 50, device=device, requires_grad=True)
    target = torch.tensor([3, 0, 0, 49, 0, 7], device=device)
    loss = kernels.cross_entropy(logits, target, ignore_index=0)
    loss.backward()
    logits_r = logits.detach().clone().requires_grad_()
    ref = reference.cross_entropy(logits_r, target, ignore_index=0)
    ref.backward()
    assert_matches(loss, ref)
    assert_matches(logits.grad, logits_r.grad)


def test_all_ignored_gives_zero_not_nan(device):
    logits = torch.randn(4, 64, device=device, requires_grad=True)
    target = torch.full((4,), -100, device=device)
    loss = kernels.cross_entropy(logits, target)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    assert reference.cross_entropy(logits, target).isnan()  # what torch does instead (0 / 0)


def test_large_logits_stay_finite(device, assert_matches):
    """Online max subtraction: logits of 1e4 would overflow a naive exp in fp32."""
    logits = torch.randn(5, 600, device=device) * 1e4
    target = targets((5,), 600, device)
    loss = kernels.CrossEntropyFunction.apply(logits, target, -100, 128)
    assert_matches(loss, reference.cross_entropy(logits, target))
