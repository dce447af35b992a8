"""The CPU redirection (primus.megatron.cpu): each patch does its job, and the megatron code it
exists for still makes the assumption it covers, so an engine upgrade that changes them fails here."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest


def _source(obj) -> str:
    return inspect.getsource(obj)


# --- what megatron-core 0.16.1 assumes (one check per patch) ---------------------------------------


def test_megatron_uses_current_device_as_a_device():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    assert "torch.cuda.current_device()" in _source(RotaryEmbedding.__init__)


def test_megatron_rng_tracker_uses_cuda_rng():
    from megatron.core.tensor_parallel import random as mrandom

    assert list(inspect.signature(mrandom._get_cuda_rng_state).parameters) == ["device", "clone", "graph_safe"]
    assert list(inspect.signature(mrandom._set_cuda_rng_state).parameters) == ["new_state", "device", "graph_safe"]
    add = _source(mrandom.CudaRNGStatesTracker.add)
    assert "torch.cuda.manual_seed(seed)" in add and "torch.cuda.get_rng_state()" in add
    assert "_get_cuda_rng_state(" in _source(mrandom.CudaRNGStatesTracker.fork)


def test_megatron_uses_streams_and_synchronize():
    from megatron.core.distributed import distributed_data_parallel, param_and_grad_buffer
    from megatron.core.pipeline_parallel import p2p_communication

    assert "torch.cuda.Stream(" in _source(distributed_data_parallel.DistributedDataParallel.__init__)
    assert "torch.cuda.stream(self.communication_stream)" in _source(param_and_grad_buffer)
    assert "torch.cuda.synchronize()" in _source(p2p_communication)


def test_megatron_asserts_cuda_tensor_types():
    from megatron.core.optimizer import clip_grads, distrib_optimizer

    assert "'torch.cuda.FloatTensor'" in _source(clip_grads.clip_grad_by_total_norm_fp32)
    assert "torch.cuda.FloatTensor" in _source(distrib_optimizer.DistributedOptimizer)
    assert "device='cuda'" in _source(clip_grads)


# --- what the patches do (in a child process: they are global) -------------------------------------

CHECK = textwrap.dedent("""
    import torch
    from primus.megatron.cpu import redirect_to_cpu
    assert redirect_to_cpu() == ["current_device", "device_mesh", "moe_splits", "rng", "streams", "device_literals"]
    from megatron.core.transformer.moe import token_dispatcher
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 4]), as_numpy=True)
    assert type(splits).__name__ == "ndarray" and splits.tolist() == [3, 4]
    from torch.distributed.device_mesh import DeviceMesh
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    assert DeviceMesh.from_group(dist.group.WORLD, "cuda").device_type == "cpu"  # megatron's FSDP2 mesh
    dist.destroy_process_group()
    assert torch.cuda.current_device() == "cpu"
    x = torch.zeros(3, device="cuda")
    assert x.device.type == "cpu" and x.cuda() is x and x.to("cuda").device.type == "cpu"
    assert torch.tensor([1, 2], device="cpu", pin_memory=True).tolist() == [1, 2]
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
    torch.cuda.synchronize()

    # megatron's RNG tracker, forked around TP-sharded init, runs on the CPU generator
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    torch.manual_seed(0)
    tracker = get_cuda_rng_tracker()
    tracker.add("model-parallel-rng", 42)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.randn(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    tracker.reset(); tracker.add("model-parallel-rng", 42)
    with tracker.fork():
        b = torch.randn(4)
    assert torch.equal(a, b)
    print("ok")
""")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the redirection applies only without a GPU")
def test_patches_redirect_cuda_to_cpu():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_megatron_fsdp2_builds_a_cuda_mesh():
    """TorchFullyShardedDataParallel names the device "cuda" for its mesh (cpu.PATCHES["device_mesh"])."""
    import inspect

    from megatron.core.distributed import TorchFullyShardedDataParallel

    assert 'DeviceMesh.from_group(self.process_group, "cuda")' in inspect.getsource(TorchFullyShardedDataParallel)


def test_megatron_pins_host_memory_for_cp_rope():
    """megatron's context-parallel RoPE builds its chunk index in pinned host memory (the device_literals patch
    drops pin_memory on a CPU-only machine)."""
    import inspect

    from megatron.core.models.common.embeddings import rope_utils

    assert "pin_memory=True" in inspect.getsource(rope_utils.get_pos_emb_on_this_cp_rank)


def test_megatron_moe_splits_become_numpy_only_off_a_gpu():
    """cpu.PATCHES["moe_splits"]: megatron's MoE dispatcher gets its all-to-all split sizes as numpy arrays from
    maybe_move_tensor_to_cpu, which converts only CUDA tensors."""
    import inspect

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    assert "tensor.is_cuda" in inspect.getsource(moe_utils.maybe_move_tensor_to_cpu)
    source = " ".join(inspect.getsource(token_dispatcher).split())
    assert "self.input_splits = maybe_move_tensor_to_cpu( self.input_splits, as_numpy=True" in source
