"""Core's run loggers (rank 0 only): console progress, ``metrics.jsonl``, TensorBoard events."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from primus.core.run.disk import no_space
from primus.core.run.rundir import relock

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
        # one line a step, piped too (rich wraps a piped console at 80 columns)
        self.console = Console(stderr=True, soft_wrap=True)
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
        if self.cfg.logging.jsonl:
            path = self.out / "metrics.jsonl"
            try:
                if self.jsonl is None:
                    _drop_rows_from(path, step)
                    self.jsonl = path.open("a")
                elif _gone(self.jsonl, path):
                    self._recreate(path, step)
                self.jsonl.write(json.dumps(row) + "\n")
                self.jsonl.flush()
            except OSError as exc:
                if (full := no_space(exc, [path])) is not None:
                    raise full from None
                raise
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

    def _recreate(self, path: Path, step: int) -> None:
        """The output folder (or metrics.jsonl) was removed during the run: the run goes on (its checkpoints are
        written again anyway), metrics.jsonl starts again at this step, next to a new config.yaml."""
        log.warning(
            "%s was removed during the run: writing it again from step %d on (the earlier rows are lost)", path, step
        )
        self.jsonl.close()
        self.out.mkdir(parents=True, exist_ok=True)
        relock(self.out)
        config = self.out / "config.yaml"
        if not config.exists():
            import yaml

            config.write_text(yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False))
        self.jsonl = path.open("a")

    def close(self, summary: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.jsonl:
            with contextlib.suppress(OSError):  # (a full disk: already said by the write that failed)
                self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        path = self.out / "summary.json"
        try:
            path.write_text(json.dumps(summary, indent=2, default=str))
        except OSError as exc:
            if (full := no_space(exc, [path])) is None:
                raise
            if summary.get("status") != "failed":
                raise full from None
            log.warning("%s", full)  # the run failed already: its own error is the one to show


def _drop_rows_from(path: Path, step: int) -> None:
    """A run's first row is for ``step``: rows of that step and later in ``path`` are an interrupted run's, written
    after the checkpoint this run resumed from; drop them (and a line cut by a kill), so that each step is in the
    file once, with this run's values. Atomic: a temporary file renamed over the old one."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] < step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    if len(kept) == len(lines):
        return
    log.info(
        "metrics.jsonl: dropped %d rows from step %d on (written after the checkpoint)", len(lines) - len(kept), step
    )
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _gone(handle: Any, path: Path) -> bool:
    """Whether the open file ``handle`` is no longer ``path`` (removed, or its folder removed or replaced)."""
    try:
        return os.fstat(handle.fileno()).st_ino != path.stat().st_ino
    except FileNotFoundError:
        return True


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


def advance(step_: int) -> None:
    """After every optimizer step: the progress bar (on a terminal) moves, whatever the logging interval."""
    if _current is not None and _current.progress is not None:
        _current.progress.update(_current.task, completed=step_)


def end(summary: dict[str, Any], info: Any) -> None:
    global _current
    if _current is not None:
        _current.close(summary)
        _current = None
