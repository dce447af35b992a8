"""The launcher: everything between a command's arguments and a rank's run: ``primus train`` (:func:`start`) and
``primus eval`` (:func:`evaluate`).

In the user's process: the config resolved at the job's world size, then what comes before anything is written (the
run folder's rules: :class:`~primus.core.run.rundir.RunFolder`; what installed plugins refuse on this machine), the
run's first line, and for several processes torchrun (:mod:`primus.core.launch.launcher`), this process holding the
run folder's lock for the whole job. In a rank (one that torchrun started, or the one process of a single-device
run): the config resolved again and the rank run (:func:`primus.core.launch.rank.run_rank`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from primus.core.launch.resolve import Resolved, resolve
from primus.core.run.rundir import LOCK_HELD_ENV, RunFolder

if TYPE_CHECKING:
    from rich.console import Console


@dataclass(frozen=True)
class Topology:
    """Where a job's processes run (``primus train``'s launcher options)."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    rdzv: str | None = None  # HOST:PORT of a c10d rendezvous (elastic; replaces master_*)

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes


def start(config: str, overrides: list[str], resume: bool, topology: Topology, console: Console) -> int:
    """``primus train CONFIG OVERRIDES``: the exit code (torchrun's for several processes;
    :data:`~primus.core.run.stop.PREEMPTED_EXIT` for a run a stop signal ended after its checkpoint). A refusal
    raises :class:`~primus.core.contracts.errors.UserError` (a ``ConfigError`` for a key) before anything is
    written; ``console`` prints the run's lines (stderr)."""
    from primus.core.run import stop

    with stop.listen_early():  # a stop signal while the run starts stops it after its first step, with a checkpoint
        return _start(config, overrides, resume, topology, console)


def _start(config: str, overrides: list[str], resume: bool, topology: Topology, console: Console) -> int:
    from primus.core.launch.launcher import LAUNCHED_ENV
    from primus.core.launch.rank import run_rank
    from primus.core.launch.run_checks import fp8_warning
    from primus.core.run import stop

    inside = bool(os.environ.get(LAUNCHED_ENV)) or "LOCAL_RANK" in os.environ
    res = resolve(config, overrides, None if inside else topology.world)  # refused before launching
    folder = RunFolder(res.config)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    with folder.one_line_if_full():
        if not inside:
            _check(res, folder, config, resume, topology.world, console)
            if topology.world > 1:
                return _launch(res, folder, [config, *overrides], resume, topology, console)
        if rank0 and (warning := fp8_warning(res.config)):
            _say(console, f"warning: {warning}", style="yellow")
        summary = run_rank(res, resume=resume)
    if rank0:
        _say(console, f"done: {json.dumps(summary, default=str)}")
    return stop.PREEMPTED_EXIT if summary.get("status") == "preempted" else 0  # the same command continues it


def _check(res: Resolved, folder: RunFolder, config: str, resume: bool, world: int, console: Console) -> None:
    """The launcher's checks, then the run's first line (a refused run prints only its error), before the engine's
    imports and build (seconds to a minute); a rank's own refusals (data, kernels on this device) follow it, still
    before anything is written."""
    from primus.core.data.checks import check_data
    from primus.core.launch.run_checks import check_plugins

    folder.check(resume)  # writable, no other live run there (creates nothing), no earlier run's unless resumed
    check_plugins(res.config, res.registry)  # what a plugin cannot do here (GEMM tuning on a CPU)
    c = res.config
    processes = f"{world} process{'es' if world > 1 else ''}"
    _say(
        console,
        f"train {config}: {c.model.name} on {c.backend.name}, {processes}, {c.train.steps} steps -> {folder.path}",
    )
    for note in res.layers.notes:  # a value the loader changed (a warmup longer than train.steps)
        _say(console, f"note: {note}")
    if world > 1:
        check_data(res.config)  # once, before the ranks start (each rank checks it too)
    if (resume or c.checkpoint.resume is True) and (warning := folder.resume_warning()):
        _say(console, f"warning: {warning}", style="yellow")


def _launch(
    res: Resolved, folder: RunFolder, argv: list[str], resume: bool, topology: Topology, console: Console
) -> int:
    """torchrun with one process a device. One node: this process holds the run folder's lock for the whole job
    (torchrun inherits it); several: each node has a launcher, and global rank 0 takes it."""
    from primus.core.launch.launcher import launch_torchrun
    from primus.core.run import stop

    if reason := stop.pending():
        _say(console, f"stopped by {reason} before the run started", style="yellow")
        return stop.PREEMPTED_EXIT
    existed = folder.path.exists()
    fd = folder.claim(resume) if topology.nnodes == 1 else None
    if fd is not None:
        os.environ[LOCK_HELD_ENV] = "1"
    rc = launch_torchrun(
        ["train", *argv] + (["--resume"] if resume else []),
        output=folder.path,
        keep_fd=fd,
        nproc_per_node=topology.nproc_per_node,
        nnodes=topology.nnodes,
        node_rank=topology.node_rank,
        master_addr=topology.master_addr,
        master_port=topology.master_port,
        rdzv=topology.rdzv,
    )
    if not existed:  # a run refused on its ranks writes nothing: only this launcher's lock is there
        folder.drop_if_only_lock()
    return rc


def _say(console: Console, text: str, style: str | None = None) -> None:
    console.print(text, style=style, highlight=False, markup=False)


def evaluate(
    config: str,
    overrides: list[str],
    checkpoint: Path | None,
    nproc_per_node: int,
    output: Path | None,
    console: Console,
) -> int:
    """``primus eval``: the evaluation loss of a checkpoint alone, one JSON line on ``console`` (stdout) and in
    ``output``; under torchrun for several processes (its exit code). ``config`` is a run folder (its config.yaml
    and, unless ``checkpoint`` is given, its checkpoints/) or a YAML file or preset with ``checkpoint``."""
    from primus.core.contracts.errors import UserError
    from primus.core.launch.env import free_port
    from primus.core.launch.launcher import LAUNCHED_ENV, launch_torchrun
    from primus.core.launch.rank import eval_rank

    config, checkpoint = run_folder(config, checkpoint)
    inside = bool(os.environ.get(LAUNCHED_ENV)) or "LOCAL_RANK" in os.environ
    res = resolve(config, overrides, None if inside else nproc_per_node)
    if not checkpoint.exists():
        raise UserError(f"--checkpoint {checkpoint}: no such folder")
    if nproc_per_node > 1 and not inside:
        argv = ["eval", config, *overrides, "--checkpoint", str(checkpoint)]
        argv += ["--output", str(output)] if output else []
        return launch_torchrun(argv, nproc_per_node=nproc_per_node, master_port=free_port())
    result = eval_rank(res, checkpoint)
    if int(os.environ.get("RANK", "0")) == 0:
        line = json.dumps(result)
        console.print(line, highlight=False, markup=False, soft_wrap=True)
        if output:
            output.write_text(line + "\n")
    return 0


def run_folder(config: str, checkpoint: Path | None) -> tuple[str, Path]:
    """A run folder stands for its ``config.yaml`` (what it trained) and, unless ``checkpoint`` is given, its
    ``checkpoints/``; a YAML file or preset needs ``checkpoint``."""
    from primus.core.contracts.errors import UserError

    folder = Path(config)
    if folder.is_dir():
        if not (folder / "config.yaml").is_file():
            raise UserError(f"{config}: a folder without config.yaml, so not a run folder")
        return str(folder / "config.yaml"), checkpoint or folder / "checkpoints"
    if checkpoint is None:
        raise UserError(f"--checkpoint is needed with {config!r} (a run folder names its own checkpoints)")
    return config, checkpoint


def profile(
    config: str, overrides: list[str], nproc_per_node: int, master_port: int, console: Console
) -> tuple[int, str | None, Path | None]:
    """``primus profile``: a few steps of the run under torch.profiler (checkpoints off), then the step-time report
    of the traces it wrote (``<output_dir>/profile/report.md`` and ``.html``). (exit code, the report's markdown, its
    folder); the exit code alone where the run or its traces failed."""
    from primus.core.profile.analyze import analyze_run
    from primus.core.profile.capture import trace_dir
    from primus.core.profile.report import html_page, markdown

    res = resolve(config, overrides, nproc_per_node, check_plugins=False)
    p = res.config.profile
    # a few steps, not the recipe's run: the profiler's schedule and one more. train.steps=N on the command line
    # gives more; fewer would end before the traced steps (an empty trace), so the schedule's count is taken then.
    needed = p.wait + p.warmup + p.active + 1
    given = {o.split("=")[0] for o in overrides}
    steps = max(res.config.train.steps, needed) if "train.steps" in given else needed
    if "train.steps" in given and res.config.train.steps < needed:
        _say(
            console,
            f"note: train.steps={res.config.train.steps} ends before the traced steps "
            f"(profile.wait + warmup + active + 1 = {needed}): running {needed}",
        )
    extra = ["profile.enabled=true", "checkpoint.enabled=false"]
    extra.append(f"train.schedule.warmup_steps={min(res.config.train.schedule.warmup_steps, steps)}")
    extra = [e for e in extra if e.split("=")[0] not in given] + [f"train.steps={steps}"]
    res = resolve(config, [*overrides, *extra], nproc_per_node)
    out_dir = RunFolder(res.config).path
    if code := start(config, [*overrides, *extra], False, Topology(nproc_per_node, master_port=master_port), console):
        return code, None, None
    traces = sorted(trace_dir(out_dir).glob("rank*.json"))
    if not traces:
        _say(console, f"error: the backend wrote no trace under {trace_dir(out_dir)}", style="red")
        return 1, None, None
    run = analyze_run(traces)  # HolisticTraceAnalysis where it can read them (GPU traces), else primus's parser
    title = f"Step time breakdown: {res.config.model.name} on {res.config.backend.name}"
    text = markdown(run, title)
    metrics = out_dir / "metrics.jsonl"
    notes = []
    if metrics.is_file():
        last = json.loads(metrics.read_text().splitlines()[-1])
        if "mfu" in last:
            notes.append(f"MFU (last logged interval): {last['mfu']:.1%}")
        if "tflops_per_device" in last:
            notes.append(f"TFLOP/s per device: {last['tflops_per_device']:.1f}")
    if notes:
        text += "\n" + "\n".join(notes) + "\n"
    report_dir = out_dir / "profile"
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "report.md").write_text(text)
    (report_dir / "report.html").write_text(html_page(run, title, notes))
    return 0, text, report_dir
