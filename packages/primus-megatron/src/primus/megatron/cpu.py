"""Run megatron-core on a machine without a GPU: redirect its CUDA calls to the CPU (CPU only).

megatron-core assumes CUDA throughout (``torch.cuda.current_device()`` as a device, ``device="cuda"``
literals, the CUDA RNG for its tracker, streams/events in the grad buffers, ``param.type() ==
'torch.cuda.FloatTensor'`` checks in the optimizer). :func:`redirect_to_cpu` applies one small,
named patch per assumption, only when ``torch.cuda.is_available()`` is false, so GPU runs are
never touched. ``tests/test_cpu_redirect.py`` checks that the megatron functions each patch exists
for still make the assumption it covers, so a megatron upgrade that changes them fails a test.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger("primus.megatron.cpu")

_applied: list[str] = []


def _current_device() -> None:
    # ``device=torch.cuda.current_device()`` is megatron's way to say "here".
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *_a, **_k: None
    torch.cuda.device_count = lambda: 0


class _DropSameRngWarning(logging.Filter):
    # With one RNG standing in for both, megatron's "CPU RNG state changed within GPU RNG context"
    # warning fires on every fork; it is expected here.
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _rng() -> None:
    # The CUDA RNG (megatron's tracker forks it around TP-sharded init and dropout) becomes the CPU RNG.
    from megatron.core.tensor_parallel import random as mrandom

    logging.getLogger(mrandom.__name__).addFilter(_DropSameRngWarning())

    def get_state(device="cuda", clone=False, graph_safe=False):  # noqa: ARG001
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):  # noqa: ARG001
        torch.set_rng_state(new_state)

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # not torch.manual_seed: that calls torch.cuda.manual_seed_all, which must stay a no-op here
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


class _NoStream:
    """Stands in for torch.cuda.Stream/Event: everything runs in order on the CPU anyway."""

    def __init__(self, *_a, **_k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        return False

    def wait_stream(self, *_a, **_k):
        pass

    def wait_event(self, *_a, **_k):
        pass

    def record_event(self, *_a, **_k):
        return _NoStream()

    def record(self, *_a, **_k):
        pass

    def wait(self, *_a, **_k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, _other):
        return 0.0


def _streams() -> None:
    torch.cuda.synchronize = lambda *_a, **_k: None
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda *_a, **_k: _NoStream()
    torch.cuda.default_stream = lambda *_a, **_k: _NoStream()
    torch.cuda.stream = lambda *_a, **_k: contextlib.nullcontext()
    torch.cuda.empty_cache = lambda: None


_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
}


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda"
    )


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (and ``.cuda()``) to the CPU, drops ``pin_memory=True``, and answers
    ``tensor.type()`` with the CUDA type name the optimizer and grad clipping assert on."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE.get(name, name)
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # page-locked host memory needs an accelerator (megatron's CP RoPE index)
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to,) and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_mode: _CudaToCpu | None = None


def _device_literals() -> None:
    global _mode
    _mode = _CudaToCpu()
    _mode.__enter__()  # stays active for the life of the process (only ever on CPU-only machines)


def _device_mesh() -> None:
    # TorchFullyShardedDataParallel (FSDP2 under megatron) builds its mesh as DeviceMesh.from_group(group, "cuda").
    from torch.distributed.device_mesh import DeviceMesh

    from_group = DeviceMesh.from_group

    def cpu_from_group(group, device_type, *args, **kwargs):
        return from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    DeviceMesh.from_group = staticmethod(cpu_from_group)


def _moe_splits() -> None:
    # megatron's MoE token dispatcher turns its all-to-all split sizes into numpy arrays while moving them off the
    # GPU (maybe_move_tensor_to_cpu converts CUDA tensors only); on a CPU they stay tensors, which gloo's
    # all_to_all_single does not take.
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


PATCHES = {
    "current_device": _current_device,
    "device_mesh": _device_mesh,
    "moe_splits": _moe_splits,
    "rng": _rng,
    "streams": _streams,
    "device_literals": _device_literals,
}


def redirect_to_cpu() -> list[str]:
    """Apply every patch once, if this machine has no GPU; returns the names applied."""
    if torch.cuda.is_available():
        return []
    for name, patch in PATCHES.items():
        if name not in _applied:
            patch()
            _applied.append(name)
    log.debug("megatron-core redirected to the CPU: %s", ", ".join(_applied))
    return list(_applied)
