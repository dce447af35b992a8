"""``primus train``'s launcher: everything between the command's arguments and a rank's run (:func:`start`).

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
