"""Capture traces during training: backends wrap their step loop with :class:`StepProfiler`.

With ``profile.enabled``, the ranks in ``profile.ranks`` run torch.profiler on the schedule
``wait → warmup → active`` (steps) and write ``<output_dir>/traces/rank<r>.json`` (Chrome trace),
which ``primus analyze`` / ``primus profile`` read. Otherwise every call is a no-op.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def trace_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "traces"


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

    def __enter__(self) -> StepProfiler:
        if self._prof is not None:
            self._prof.__enter__()
        return self

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def __exit__(self, *exc: Any) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)
