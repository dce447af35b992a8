"""Environment defaults for multi-GPU runs, by GPU family: the one place to read and change them.

Each value says why it is set. Site-specific settings (network interfaces, HCAs) cannot have a
default; they are listed commented out in generated Slurm scripts. A variable already set in the
environment, or given with ``--env``, wins over these.
"""

from __future__ import annotations

from pathlib import Path

COMMON: dict[str, tuple[str, str]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("1", "a failed or timed-out collective aborts the job instead of hanging"),
    "CUDA_DEVICE_MAX_CONNECTIONS": ("1", "Megatron's TP/SP comm overlap needs kernels submitted in order"),
    "PYTORCH_CUDA_ALLOC_CONF": ("expandable_segments:True", "less allocator fragmentation with varying shapes"),
    "NCCL_DEBUG": ("WARN", "NCCL/RCCL report problems without flooding the log"),
}

NVIDIA: dict[str, tuple[str, str]] = {
    "NCCL_IB_TIMEOUT": ("22", "tolerate slow InfiniBand links before declaring a peer dead"),
}

AMD: dict[str, tuple[str, str]] = {
    "NCCL_IB_GID_INDEX": ("3", "RoCE v2 GID on the usual AMD cluster NICs (RCCL reads NCCL_* variables)"),
    "NCCL_CROSS_NIC": ("0", "keep each ring on one NIC rail"),
    "NCCL_CHECKS_DISABLE": ("1", "skip RCCL's argument checks on every call"),
    "RCCL_MSCCL_ENABLE": ("0", "MSCCL algorithms off: the default rings/trees are the tested path"),
    "GPU_MAX_HW_QUEUES": ("2", "fewer hardware queues lets communication and compute kernels overlap on MI300"),
    "HIP_FORCE_DEV_KERNARG": ("1", "kernel arguments in device memory: lower launch latency"),
    "TORCH_BLAS_PREFER_HIPBLASLT": ("1", "GEMMs through hipBLASLt (what GEMM tuning tunes)"),
}

SITE_SPECIFIC = ["NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA"]

FAMILIES = {"nvidia": NVIDIA, "amd": AMD, "cpu": {}}


def defaults(family: str) -> dict[str, tuple[str, str]]:
    if family not in FAMILIES:
        raise ValueError(f"unknown GPU family {family!r}; allowed: {', '.join(FAMILIES)}")
    return {} if family == "cpu" else {**COMMON, **FAMILIES[family]}


EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A free TCP port on this host for a rendezvous (torchrun's store, or a single-process run's), taken below the
    kernel's ephemeral range (``ip_local_port_range``, 32768-60999 by default): a port the kernel hands out for
    ``bind(0)`` is one it also hands to outgoing connections (gloo's, other runs' stores), which can take it between
    this check and the store's bind (EADDRINUSE). A random pick in 20000-32767 that binds now; ``bind(0)`` where
    none does (or the range starts lower)."""
    import random
    import socket

    try:
        low = int(EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.SystemRandom()
    for port in (pick.randrange(20000, low) for _ in range(64)) if low > 20000 else ():
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
