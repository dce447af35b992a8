"""Context-parallel attention (primus.turbo.context_parallel) against single-device SDPA, fp32 on CPU with gloo.

One set of 4 forked processes serves every distributed assertion: the world (cp 4) and its two halves (cp 2,
global ranks 0-1 and 2-3: a subgroup whose ranks are not the global ones) each run every case with both
variants and save their local outputs and gradients; the tests here put the shards back together with
``unshard_from_cp`` and compare them with ``scaled_dot_product_attention`` over the whole sequence (K/V repeated
for the reference only).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from primus.core.config.schema import KernelsConfig
from primus.core.kernels.selection import select_kernels
from primus.core.launch.env import free_port as _free_port
from primus.turbo import availability
from primus.turbo.context_parallel import (
    VARIANTS,
    attention,
    ring_attention,
    shard_for_cp,
    unshard_from_cp,
)

WORLD = 4
B, S, D = 2, 48, 16  # 48 = 2·cp·L for cp 2 (L 12) and cp 4 (L 6)
# name -> (query heads, key/value heads, causal, scale)
CASES = {
    "causal": (4, 4, True, None),
    "causal-gqa2": (4, 2, True, None),
    "causal-gqa1": (4, 1, True, None),
    "causal-gqa2-scale0.3": (4, 2, True, 0.3),
    "full": (4, 4, False, None),
    "full-gqa2": (4, 2, False, None),
}
# the cp groups each rank belongs to, and which global ranks form each group's shards, in group-rank order
GROUPS = {"cp4": [0, 1, 2, 3], "cp2a": [0, 1], "cp2b": [2, 3]}
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _inputs(name: str) -> dict[str, torch.Tensor]:
    h, hk, _, _ = CASES[name]
    gen = torch.Generator().manual_seed(sorted(CASES).index(name))
    shapes = {"q": (B, S, h, D), "k": (B, S, hk, D), "v": (B, S, hk, D), "dout": (B, S, h, D)}
    return {key: torch.randn(shape, generator=gen) for key, shape in shapes.items()}


def _reference(name: str) -> dict[str, torch.Tensor]:
    """Output and dq/dk/dv of SDPA over the whole sequence ([b, s, h, d] in and out)."""
    h, hk, causal, scale = CASES[name]
    x = _inputs(name)
    q, k, v = (x[key].clone().requires_grad_() for key in "qkv")
    rep = h // hk
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(rep, dim=2).transpose(1, 2),
        v.repeat_interleave(rep, dim=2).transpose(1, 2),
        is_causal=causal,
        scale=scale,
    ).transpose(1, 2)
    out.backward(x["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


# --- the worker: runs in each of the 4 forked processes -------------------------------------------------------


def _run(group, cp: int, rank: int, name: str, variant: str, core_layout: bool = False) -> dict[str, torch.Tensor]:
    _, _, causal, scale = CASES[name]
    x = {key: shard_for_cp(t, cp, rank) for key, t in _inputs(name).items()}
    q, k, v = (x[key].requires_grad_() for key in "qkv")
    if core_layout:  # the provider's entry point: [b, h, s, d]
        out = attention.context_parallel(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), group=group, causal=causal, scale=scale
        ).transpose(1, 2)
    else:
        out = ring_attention(q, k, v, group=group, causal=causal, scale=scale, variant=variant)
    out.backward(x["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _refusal(group, **kwargs) -> str:
    q = torch.zeros(1, 7, 2, 4)  # 7 local positions: not two equal chunks
    try:
        ring_attention(q, q, q, group=group, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no ValueError"


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # 4 processes share the machine's cores
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=WORLD,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=60),  # a hang fails instead of blocking the test run
    )
    groups = {key: dist.new_group(ranks) for key, ranks in GROUPS.items()}  # every rank creates every group
    results: dict[str, object] = {}
    for key, ranks in GROUPS.items():
        if rank not in ranks:
            continue
        group, cp, local = groups[key], len(ranks), ranks.index(rank)
        for name in CASES:
            for variant in VARIANTS:
                results[f"{key}/{variant}/{name}"] = _run(group, cp, local, name, variant)
        results[f"{key}/core-layout/causal-gqa2"] = _run(group, cp, local, "causal-gqa2", "ring", core_layout=True)
        results[f"{key}/odd-length"] = _refusal(group)
        results[f"{key}/bad-variant"] = _refusal(group, variant="p2p")
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[dict]:
    """Each global rank's saved results, from one run of the 4 processes (forked: no re-import of torch)."""
    out_dir = tmp_path_factory.mktemp("cp")
    ctx = mp.start_processes(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=False, start_method="fork")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):  # raises, with the worker's traceback, if one of them failed
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("context-parallel workers did not finish in 120 s")
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD)]


def _gathered(shards: list[dict], key: str, ranks: list[int]) -> dict[str, torch.Tensor]:
    parts = [shards[rank][key] for rank in ranks]
    return {name: unshard_from_cp([p[name] for p in parts], len(ranks)) for name in parts[0]}


# --- distributed: outputs and gradients equal single-device attention -------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_matches_single_device_attention(shards, group, variant, name):
    got = _gathered(shards, f"{group}/{variant}/{name}", GROUPS[group])
    want = _reference(name)
    for key in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_core_layout_entry_point(shards, group):
    got = _gathered(shards, f"{group}/core-layout/causal-gqa2", GROUPS[group])
    want = _reference("causal-gqa2")
    for key in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(got[key], want[key], **TOL)


@pytest.mark.parametrize(("group", "cp"), [("cp2a", 2), ("cp4", 4)])
def test_odd_local_length_is_refused_naming_the_sizes(shards, group, cp):
    message = shards[GROUPS[group][0]][f"{group}/odd-length"]
    assert message == (
        f"ring_attention: 7 local positions are not two equal chunks: the global sequence "
        f"(7 × cp {cp} = {7 * cp}) is not divisible by 2·cp = {2 * cp}"
    )
    assert "variant must be one of ring, allgather (got 'p2p')" in shards[GROUPS[group][0]][f"{group}/bad-variant"]


# --- the layout helpers ----------------------------------------------------------------------------------------


def test_shard_layout_is_load_balanced():
    x = torch.arange(16)
    assert shard_for_cp(x, 2, 0, seq_dim=0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_for_cp(x, 2, 1, seq_dim=0).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard_for_cp(x, 4, 3, seq_dim=0).tolist() == [6, 7, 8, 9]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("seq_dim", [0, 1, 2])
def test_shard_unshard_round_trip(cp, seq_dim):
    x = torch.randn(8, 16, 24)
    parts = [shard_for_cp(x, cp, rank, seq_dim=seq_dim) for rank in range(cp)]
    assert all(p.shape[seq_dim] == x.shape[seq_dim] // cp for p in parts)
    assert torch.equal(unshard_from_cp(parts, cp, seq_dim=seq_dim), x)


def test_length_not_divisible_by_2cp_is_refused():
    with pytest.raises(ValueError) as info:
        shard_for_cp(torch.zeros(2, 30, 4), 4, 0)
    assert str(info.value) == (
        "sequence length 30 is not divisible by 2·cp = 8 (cp=4): the load-balanced context-parallel layout "
        "cuts the sequence into 8 equal chunks"
    )
    with pytest.raises(ValueError, match="rank 2 is outside the context-parallel group of size 2"):
        shard_for_cp(torch.zeros(2, 32, 4), 2, 2)
    with pytest.raises(ValueError, match="3 parts for cp=2"):
        unshard_from_cp([torch.zeros(2, 8)] * 3, 2)


# --- the provider -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_sequence_impl_matches_sdpa(name):
    """The ``ring`` provider's impl at cp 1: core's contract ``[b, h, s, d]``, no process group."""
    _, _, causal, scale = CASES[name]
    x = _inputs(name)
    q, k, v = (x[key].transpose(1, 2).clone().requires_grad_() for key in "qkv")
    out = attention(q, k, v, causal=causal, scale=scale)
    out.backward(x["dout"].transpose(1, 2))
    want = _reference(name)
    torch.testing.assert_close(out.transpose(1, 2), want["out"], **TOL)
    for got, key in ((q, "dq"), (k, "dk"), (v, "dv")):
        torch.testing.assert_close(got.grad.transpose(1, 2), want[key], **TOL)


def test_ring_provider_declares_context_parallel(registry):
    ring = next(p for p in registry.providers("attention") if p.name == "ring")
    assert (ring.priority, ring.dist, ring.features) == (5, "primus-turbo", frozenset({"context_parallel"}))
    assert ring.load() is attention and callable(ring.load().context_parallel)
    assert not any("context_parallel" in p.features for p in registry.providers("attention") if p.name != "ring")


def test_cp_constraint_selects_ring_only_when_the_sequence_is_split(registry):
    assert select_kernels(KernelsConfig(), registry, "cpu", dtype="fp32", head_dim=16)["attention"].name == "sdpa"
    assert select_kernels(KernelsConfig(), registry, "cpu", cp=1)["attention"].name == "sdpa"
    assert select_kernels(KernelsConfig(), registry, "cpu", dtype="bf16", cp=2)["attention"].name == "ring"
    assert (
        availability.ring("cpu").reason
        == "ring attention is for a sequence split over parallel.cp > 1 ranks (cp=1 here)"
    )
    assert availability.ring("cuda", cp=4, dtype="bf16", head_dim=128)


def test_whole_sequence_providers_refuse_cp(fake_aiter, rocm_torch):
    reason = (
        "attends over the whole sequence on one device; parallel.cp=2 needs an attention provider with the "
        "'context_parallel' feature (primus-turbo's 'ring')"
    )
    assert availability.flash("rocm", dtype="bf16", head_dim=128, cp=2).reason == reason
    assert availability.aiter("rocm", dtype="bf16", head_dim=128, cp=2).reason == reason
    assert availability.aiter("rocm", dtype="bf16", head_dim=128, cp=1)
    assert availability.cudnn("cpu", cp=2).reason == "no CUDA device"  # the device is still named first
