"""The FP8 linear under tensor parallelism: 2 CPU processes (gloo), an MLP ``w2(relu(w1(x) + b1)) + b2`` sharded the way
torch's ColwiseParallel / RowwiseParallel shard it, against the same FP8 MLP on one process and against fp32.

Bounds: FP8 (e4m3 forward, e5m2 gradients) on these random inputs errs 5-19% from fp32 (measured; the input and
first weight's gradients pass two e5m2 casts); each shard is scaled on its own, so TP and one process differ by
2.5-6.5%. TP must err no more than one process does (10% slack). A wrong gradient placement (the colwise input's dgrad
not summed over the ranks) puts the input gradient ~50% off, a missing output reduction the output ~70%.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from primus.turbo.fp8.linear import convert_to_fp8
from primus.turbo.fp8.recipe import Fp8Recipe

D, H, TOKENS = 64, 128, 32


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))  # biases: sharded (colwise), replicated (rowwise)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(TOKENS, D, generator=g), torch.randn(TOKENS, D, generator=g)


def _run(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    loss = ((y.float() - target) ** 2).mean()
    loss.backward()
    grads = {f"d{name}": p.grad for name, p in model.named_parameters()}  # d0.weight, d0.bias, d2.weight, d2.bias
    return {"y": y.float().detach(), "dx": x.grad, **grads}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _worker(rank: int, store: str, mode: str, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = _mlp()
        convert_to_fp8(model, Fp8Recipe(mode=mode))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        assert isinstance(model[0].weight, DTensor) and isinstance(model[2].weight, DTensor)
        got = _run(model, *_inputs())
        got = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in got.items()}
        if rank == 0:
            out.update({k: v.clone() for k, v in got.items()})
        torch.distributed.barrier()  # both ranks done, rank 0's hand-off included
    finally:
        torch.distributed.destroy_process_group()
    # gloo with a DeviceMesh aborts a process at interpreter teardown now and then, after the work is done ("terminate
    # called without an active exception": twice in CI, the barrier above notwithstanding). The result is handed off:
    # leave without that teardown, as primus.torchtitan.runner's _exit_quietly_after_success does. A failure above
    # raises before this line and exits non-zero with its traceback.
    os._exit(0)


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_tp2_fp8_mlp_matches_one_process(mode, tmp_path):
    if not torch.distributed.is_gloo_available():
        pytest.skip("torch built without gloo")
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(str(tmp_path / "store"), mode, out), nprocs=2, join=True)
    tp = dict(out)
    one = _mlp()
    convert_to_fp8(one, Fp8Recipe(mode=mode))
    single = _run(one, *_inputs())
    with torch.autocast("cpu", enabled=False):  # the fp32 reference
        ref = _run(_mlp(), *_inputs())
    assert set(tp) == {"y", "dx", "d0.weight", "d0.bias", "d2.weight", "d2.bias"}
    for key in tp:
        assert torch.isfinite(tp[key]).all(), key
        err_one, err_tp = _rel(single[key], ref[key]), _rel(tp[key], ref[key])
        assert err_one < 0.25 and err_tp < 1.1 * err_one + 0.01, (key, err_tp, err_one)
        assert _rel(tp[key], single[key]) < 0.1, (key, _rel(tp[key], single[key]))
