"""Devices the planner knows: memory, dense bf16 and FP8 peaks, HBM and collective bandwidths.

Bandwidths in GB/s: ``hbm`` the datasheet memory bandwidth; ``intra`` / ``inter`` the per GPU "bus
bandwidth" of a ring collective (what nccl-tests / rccl-tests report) inside a node (NVLink / Infinity
Fabric) and across nodes (one 400 Gb/s NIC per GPU gives ~40-45 GB/s). ``fp8_peak_flops`` is the dense
(no sparsity) FP8 peak, 0 where the device has no FP8 tensor cores. How much of these peaks a training
step reaches is in :mod:`primus.core.planner.calibration` (the rate of a step's memory-bound work, where measured:
``STEP_HBM_GBPS``, :attr:`Device.step_hbm_gbps`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from primus.core.planner import calibration as cal


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    peak_flops: float
    intra_gbps: float
    inter_gbps: float
    hbm_gbps: float
    fp8_peak_flops: float = 0.0

    @property
    def gemm_fraction(self) -> float:
        return cal.GEMM_FRACTION[self.name]

    @property
    def attention_fraction(self) -> float:
        return cal.ATTENTION_FRACTION[self.name]

    @property
    def step_hbm_gbps(self) -> float:
        """GB/s a training step's memory-bound work runs at (the step-time model's; ``calibration.STEP_HBM_GBPS``,
        the datasheet's where not measured)."""
        return cal.STEP_HBM_GBPS.get(self.name, self.hbm_gbps)


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # memory: what the runtime reports (torch.cuda.get_device_properties().total_memory) where measured here,
        # so a plan named for a device and parallel.strategy=auto on one see the same GiB; else the datasheet's
        Device("H100", 79.18, 989e12, 360, 45, 3350, 1979e12),  # 85,017,493,504 B (H100 80GB HBM3, 2026-12-07)
        Device("H200", 139.80, 989e12, 360, 45, 4800, 1979e12),
        Device("B200", 180, 2250e12, 720, 45, 8000, 4500e12),
        Device("A100", 80, 312e12, 230, 22, 2039, 0.0),
        Device("MI300X", 192, 1307e12, 300, 45, 5300, 2615e12),
        Device("MI325X", 256, 1307e12, 300, 45, 6000, 2615e12),
        Device("MI355X", 288, 2500e12, 330, 45, 8000, 5000e12),
        Device("CPU", 24, 1e12, 10, 1, 100, 0.0),
    )
}


def device(name: str, memory_gib: float | None = None) -> Device:
    """A known device by (case-insensitive, substring) name, its memory overridable."""
    key = next((k for k in DEVICES if k.lower() == name.lower()), None)
    key = key or next((k for k in DEVICES if k.lower() in name.lower()), None)
    if key is None:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    d = DEVICES[key]
    return d if memory_gib is None else dataclasses.replace(d, memory_gib=memory_gib)
