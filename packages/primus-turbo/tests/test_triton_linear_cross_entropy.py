"""Fused linear + cross-entropy: same loss and gradients as ``F.linear`` then core's reference
cross-entropy, and memory that grows with the chunk, not with tokens x vocab."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

pytest.importorskip("triton")

from primus.core.kernels import reference  # noqa: E402
from primus.turbo.triton import linear_cross_entropy as fused  # noqa: E402


def problem(device, n, d, vocab, dtype=torch.float32, ignore_every=7):
    torch.manual_seed(0)
    hidden = torch.randn(n, d, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, d, device=device) / d**0.5).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (n,), device=device)
    if ignore_every:
        target[::ignore_every] = -100
    return hidden, weight, target


def reference_loss(hidden, weight, target, scale=1.0):
    h, w = (t.detach().float().requires_grad_() for t in (hidden, weight))
    loss = reference.cross_entropy(h @ w.T, target)
    (scale * loss).backward()
    return loss, h.grad, w.grad


@pytest.mark.parametrize(
    ("n", "vocab", "chunk", "block", "dtype"),
    [
        (40, 300, 16, 128, torch.float32),  # 3 chunks, the last partial; vocab off the block grid
        (33, 257, None, None, torch.float32),  # default chunk: one chunk
        (24, 200, 8, 64, torch.bfloat16),
    ],
    ids=["chunks-16", "default-chunk", "bf16"],
)
def test_matches_linear_then_cross_entropy(device, assert_matches, n, vocab, chunk, block, dtype):
    hidden, weight, target = problem(device, n, 16, vocab, dtype)
    loss = fused.LinearCrossEntropyFunction.apply(hidden, weight, target, -100, chunk, block)
    (2.5 * loss).backward()
    ref, d_hidden, d_weight = reference_loss(hidden, weight, target, scale=2.5)

    assert loss.dtype == torch.float32
    assert_matches(loss, ref, dtype)
    assert_matches(hidden.grad, d_hidden, dtype)
    assert_matches(weight.grad, d_weight, dtype)
    assert not hidden.grad[::7].any()  # ignored tokens


def test_no_grad_and_one_sided_grads(device, assert_matches):
    hidden, weight, target = problem(device, 20, 8, 90)
    ref, _, d_weight = reference_loss(hidden, weight, target)
    with torch.no_grad():
        assert_matches(fused.linear_cross_entropy(hidden, weight, target, chunk_size=8), ref)

    frozen_hidden = hidden.detach()  # e.g. a frozen trunk: only the head trains
    fused.linear_cross_entropy(frozen_hidden, weight, target, chunk_size=8).backward()
    assert_matches(weight.grad, d_weight)


def test_batch_shaped_tokens_and_autocast(device, assert_matches):
    """hidden [b, s, d] with target [b, s] is flattened; autocast does not reach the fp32 GEMMs inside."""
    hidden, weight, target = problem(device, 20, 8, 90)
    ref, d_hidden, _ = reference_loss(hidden, weight, target)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = fused.linear_cross_entropy(hidden.view(4, 5, 8), weight, target.view(4, 5), chunk_size=8)
    loss.backward()
    assert_matches(loss, ref)
    assert_matches(hidden.grad, d_hidden)


def test_all_ignored_gives_zero_not_nan(device):
    hidden, weight, _ = problem(device, 6, 8, 30)
    loss = fused.linear_cross_entropy(hidden, weight, torch.full((6,), -100, device=device))
    loss.backward()
    assert loss.item() == 0.0
    assert not hidden.grad.any() and not weight.grad.any()


def test_default_chunk_keeps_the_logits_within_budget():
    llama_vocab = 128256
    chunk = fused.default_chunk_size(8192, llama_vocab, 2)
    assert chunk == 1024
    assert chunk * llama_vocab * 2 <= fused.CHUNK_BUDGET_BYTES
    assert fused.default_chunk_size(8192, llama_vocab, 4) == 512  # fp32 logits: half the tokens
    assert fused.default_chunk_size(100, llama_vocab, 2) == 100  # never more than there are tokens
    assert fused.default_chunk_size(8192, 10**7, 2) == fused.MIN_CHUNK  # a floor, so GEMMs stay efficient


class AllocationTracker(TorchDispatchMode):
    """Counts the bytes of every storage torch allocates while active (views are not new storage) and
    the peak of those still alive: an allocator-independent measure of a function's extra memory.
    Storages of ``inputs`` (allocated before) are not counted when views of them come by."""

    def __init__(self, inputs=()):
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        new = {}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage, key = t.untyped_storage(), t.untyped_storage().data_ptr()
                known = key in self.live and not self.live[key][0].expired()  # (an address can be reused)
                if not known and key not in self.inputs and storage.nbytes():
                    new[key] = (StorageWeakRef(storage), storage.nbytes())
        if new:
            # Triton's interpreter leaves reference cycles holding a launch's arguments (a GPU launch does
            # not): count only what is still reachable, as the allocator would have it.
            if max(n for _, n in new.values()) >= 4096:  # collecting is slow: before the allocations that matter
                gc.collect()
            self.live = {k: v for k, v in self.live.items() if not v[0].expired()} | new
            self.largest = max(self.largest, *(n for _, n in new.values()))
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def measure(fn, hidden, weight, target):
    with AllocationTracker(inputs=(hidden, weight, target)) as tracker:
        fn(hidden, weight, target).backward()
    return tracker


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts CPU allocations; on a GPU the benchmark measures")
def test_memory_grows_with_the_chunk_not_with_tokens_times_vocab(device):
    vocab, d, chunk, n = 2048, 8, 16, 32
    unfused = measure(lambda h, w, t: reference.cross_entropy(h @ w.T, t), *problem(device, n, d, vocab))
    small = measure(
        lambda h, w, t: fused.linear_cross_entropy(h, w, t, chunk_size=chunk), *problem(device, n, d, vocab)
    )
    large = measure(
        lambda h, w, t: fused.linear_cross_entropy(h, w, t, chunk_size=chunk), *problem(device, 4 * n, d, vocab)
    )

    full_logits = n * vocab * 4
    assert unfused.largest >= full_logits  # the tracker sees the [N, V] logits of the unfused path
    assert unfused.peak >= 2 * full_logits
    assert small.largest <= chunk * vocab * 4  # nothing bigger than one chunk of logits
    # the bound the module docstring states: one chunk of logits + d_weight + per-token state
    per_token = d * 4 + 4 + 4 + 1  # d_hidden, loss, lse, the ignore mask
    assert small.peak <= chunk * vocab * 4 + vocab * d * 4 + n * per_token + 1024
    # 4x the tokens: the peak grows by the per-token state only, not by N x V
    assert large.peak - small.peak <= 3 * n * per_token + 1024
