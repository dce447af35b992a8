"""Devices the planner knows: memory, dense bf16 peak, and the bandwidth collectives see.

Bandwidths are per GPU "bus bandwidth" of a ring collective (what nccl-tests / rccl-tests report), in
GB/s: ``intra`` inside a node (NVLink / Infinity Fabric), ``inter`` across nodes (one 400 Gb/s NIC per
GPU gives ~40-45 GB/s). ``efficiency`` is the fraction of peak a well-tuned dense transformer step
reaches in its GEMMs and attention (the MFU ceiling the step-time estimate divides by); it is a
planning constant, set from public figures and our H200 baseline (51-57% MFU on 1B/3B at seq 4096).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    peak_flops: float
    intra_gbps: float
    inter_gbps: float
    efficiency: float = 0.5


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("H100", 80, 989e12, 360, 45, 0.5),
        Device("H200", 141, 989e12, 360, 45, 0.52),
        Device("B200", 180, 2250e12, 720, 45, 0.45),
        Device("A100", 80, 312e12, 230, 22, 0.55),
        Device("MI300X", 192, 1307e12, 300, 45, 0.4),
        Device("MI325X", 256, 1307e12, 300, 45, 0.4),
        Device("MI355X", 288, 2500e12, 330, 45, 0.35),
        Device("CPU", 24, 1e12, 10, 1, 0.5),
    )
}


def device(name: str, memory_gib: float | None = None) -> Device:
    """A known device by (case-insensitive, substring) name, its memory overridable."""
    key = next((k for k in DEVICES if k.lower() == name.lower()), None)
    key = key or next((k for k in DEVICES if k.lower() in name.lower()), None)
    if key is None:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    d = DEVICES[key]
    if memory_gib is not None:
        d = Device(d.name, memory_gib, d.peak_flops, d.intra_gbps, d.inter_gbps, d.efficiency)
    return d
