"""Capture traces during training: backends wrap their step loop with :class:`StepProfiler`.

With ``profile.enabled``, the ranks in ``profile.ranks`` run torch.profiler on the schedule
``wait → warmup → active`` (steps) and write ``<output_dir>/traces/rank<r>.json`` (Chrome trace),
which ``primus analyze`` / ``primus profile`` read. Otherwise every call is a no-op.

Each trace carries a top-level ``"primus"`` block (:func:`trace_metadata`): the model FLOPs one step
costs this device, the device's dense bf16 peak and the number of traced steps, so that a trace alone
gives the step time and MFU; and the run's model, backend, device, parallel layout and selected kernels, which
the report's run summary shows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def trace_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "traces"


def trace_metadata(cfg: Any, info: Any) -> dict[str, Any]:
    """What ``primus analyze`` needs besides the kernels: FLOPs per step on one device, peak, steps traced."""
    t, p = cfg.train, cfg.parallel
    world = max(int(getattr(info, "world_size", 1) or 1), 1)
    model_parallel = p.tp * p.pp * p.cp
    samples = t.global_batch_size or t.micro_batch_size * max(world // model_parallel, 1)
    tokens_per_device = samples * t.seq_len / world
    return {
        "model": cfg.model.name,
        "backend": cfg.backend.name,
        "seq_len": t.seq_len,
        "tokens_per_step_per_device": tokens_per_device,
        "flops_per_token": info.flops_per_token,
        "model_flops_per_step_per_device": tokens_per_device * info.flops_per_token,
        "peak_flops": info.peak_flops,
        "device_name": (info.extra or {}).get("device_name"),
        "active_steps": cfg.profile.active,
        "fp8": cfg.kernels.fp8,
        # the report's run summary: the parallel layout and the kernel providers the backend selected
        "layout": {
            "world": world,
            "tp": p.tp,
            "pp": p.pp,
            "cp": p.cp,
            "dp_replicate": p.dp_replicate,
            "dp_shard": p.dp_shard,
        },
        "kernels": {str(k): str(v) for k, v in (getattr(info, "kernels", None) or {}).items()},
    }


class StepProfiler:
    def __init__(self, cfg: Any, info: Any) -> None:
        self._prof = None
        p = cfg.profile
        if not p.enabled or info.rank not in p.ranks:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        path = trace_dir(info.output_dir) / f"rank{info.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=p.wait, warmup=p.warmup, active=p.active, repeat=1),
            on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)),
            record_shapes=False,
        )
        self._meta = json.dumps(trace_metadata(cfg, info))

    def __enter__(self) -> StepProfiler:
        if self._prof is not None:
            self._prof.__enter__()
            self._tag()
        return self

    def _tag(self) -> None:
        # kineto keeps metadata only while a session is open (warmup or active), so add it then
        from torch.profiler import ProfilerAction

        if self._prof.current_action != ProfilerAction.NONE:
            self._prof.add_metadata_json("primus", self._meta)

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()
            self._tag()

    def __exit__(self, *exc: Any) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)
