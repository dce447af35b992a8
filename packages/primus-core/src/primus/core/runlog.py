"""Core's run loggers (rank 0 only): console progress, ``metrics.jsonl``, TensorBoard events."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

log = logging.getLogger("primus.run")


class _RunLog:
    def __init__(self, config: Any, info: Any) -> None:
        self.cfg = config
        self.out = Path(info.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.jsonl = None  # opened at the first step: a run refused at start leaves no empty metrics file
        self.tb = None
        if config.logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.out / "tensorboard"))
            except Exception as exc:  # noqa: BLE001 - tensorboard is optional
                log.warning("tensorboard disabled: %s", exc)
        self.console = Console(stderr=True)
        self.progress = None
        if config.logging.progress and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task("train", total=config.train.steps, status="")
            self.progress.start()

    def step(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time(), **metrics}
        if self.jsonl is None and self.cfg.logging.jsonl:
            self.jsonl = (self.out / "metrics.jsonl").open("a")
        if self.jsonl:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for key, val in metrics.items():
                if isinstance(val, (int, float)):
                    self.tb.add_scalar(key, val, step)
        line = format_metrics(step, self.cfg.train.steps, metrics)
        if self.progress is not None:
            self.progress.update(self.task, completed=step, status=f"loss {metrics.get('loss', float('nan')):.4f}")
            self.progress.console.print(line, highlight=False)
        else:
            self.console.print(line, highlight=False)

    def close(self, summary: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.jsonl:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


def format_metrics(step: int, steps: int, m: dict[str, float]) -> str:
    parts = [f"step {step:>5}/{steps}"]
    for key, fmt in (
        ("loss", "loss {:.4f}"),
        ("grad_norm", "gnorm {:.3f}"),
        ("lr", "lr {:.2e}"),
        ("tokens_per_s_per_device", "{:,.0f} tok/s/dev"),
        ("tflops_per_device", "{:.1f} TFLOP/s/dev"),
        ("mfu", "MFU {:.1%}"),
        ("memory_gib", "mem {:.1f} GiB"),
        ("eval_loss", "eval loss {:.4f}"),
        ("eval_perplexity", "ppl {:.2f}"),
    ):
        if key in m:
            parts.append(fmt.format(m[key]))
    return " | ".join(parts)


_current: _RunLog | None = None


def start(config: Any, info: Any) -> None:
    global _current
    if info.rank == 0:
        _current = _RunLog(config, info)


def step(step_: int, metrics: dict[str, float], info: Any) -> None:
    if _current is not None:
        _current.step(step_, metrics)


def end(summary: dict[str, Any], info: Any) -> None:
    global _current
    if _current is not None:
        _current.close(summary)
        _current = None
