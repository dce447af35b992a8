"""One run: resolve and validate the config, select kernels, hand over to the backend on each rank.

``launch`` runs in the user's process: one device trains in process; more devices re-run ``primus
train`` under ``torch.distributed.run`` (torchrun), one process per device.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from primus.core.config.loader import Layered, load_layers, nest
from primus.core.config.presets import resolver
from primus.core.config.schema import PrimusConfig
from primus.core.config.validate import resolve_parallel, validate_config
from primus.core.contracts.plugins import Registry, get_registry
from primus.core.contracts.protocols import RunContext, RunInfo
from primus.core.run.init_from import apply_layers
from primus.core.run.rundir import LOCK_HELD_ENV, hold, output_dir, release
from primus.core.run.stop import TORCHRUN_SIGNALS

log = logging.getLogger("primus.train")

LAUNCHED_ENV = "PRIMUS_LAUNCHED"


@dataclass
class Resolved:
    config: PrimusConfig
    layers: Layered
    registry: Registry
    world_size: int


def configure_changes(registry: Registry):
    """Run every plugin's ``primus_configure`` and label its change with the plugin's distribution. Where two
    plugins set one key, the one pluggy calls first wins (``tryfirst``, else the one registered last)."""

    def run(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        changes = []
        for plugin_name, call in registry.pm.each_impl("primus_configure"):
            change = Layered()
            for result in call(config=data):
                for key, value in (result or {}).items():
                    change.merge(nest(key, value), "")
            if change.data:
                changes.append((f"plugin {registry.pm.dist_of(plugin_name)}", change.data))
        return changes[::-1]  # merged in list order: the first called is merged last, so it wins

    return run


def resolve(
    config: str | None,
    overrides: list[str] = (),
    world_size: int | None = None,
    registry: Registry | None = None,
    check_plugins: bool = True,
) -> Resolved:
    """Load, layer and validate; ``check_plugins=False`` skips the checks that need installed plugins
    (backend and kernel names), so ``primus config show`` works with primus-core alone."""
    registry = registry or get_registry()
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    layers = load_layers(config, overrides, resolver(registry), configure=configure_changes(registry))
    apply_layers(layers)  # train.init_from: a Hugging Face folder's config.json is the model's layer
    cfg = validate_config(layers.data, world_size=world_size, registry=registry if check_plugins else None)
    strategy = cfg.parallel.strategy
    if strategy not in ("auto", "manual"):
        from primus.core.contracts.protocols import load_ref

        # a named strategy fills the parallel section; sizes the user set explicitly stay as given
        explicit = {
            k.split(".")[1] for k in layers.sources if k.startswith("parallel.") and layers.sources[k] != "default"
        }
        filled = load_ref(registry.strategies[strategy].fill)(cfg.parallel.model_dump(), world_size, cfg)
        kept = {k: v for k, v in filled.items() if k not in explicit or k == "strategy"}
        data = cfg.model_dump()
        data["parallel"] = {**data["parallel"], **kept}
        cfg = validate_config(data, world_size=world_size, registry=registry if check_plugins else None)
    if cfg.parallel.strategy == "auto":
        from primus.core.planner.auto import choose

        explicit = {k.split(".")[1] for k in layers.sources if k.startswith("parallel.")}
        cfg = validate_config(choose(cfg, explicit, world_size, registry=registry).model_dump(), world_size=world_size)
    return Resolved(resolve_parallel(cfg, world_size), layers, registry, world_size)


EARLIER_RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints")


def check_output_dir(cfg: PrimusConfig, resume: bool) -> None:
    """Refuse to start a fresh run in a folder that holds an earlier run's results (nothing is overwritten);
    ``--resume`` continues it instead."""
    from primus.core.contracts.errors import UserError

    out = output_dir(cfg)
    found = [name for name in EARLIER_RUN_FILES if (out / name).exists() and not _empty_dir(out / name)]
    if found and not (resume or cfg.checkpoint.resume):
        raise UserError(
            f"logging.output_dir {out} holds an earlier run ({', '.join(found)}); pass --resume to "
            "continue it, or choose another logging.output_dir"
        )


def claim_output_dir(cfg: PrimusConfig, resume: bool) -> int | None:
    """Lock the output folder for this run (:func:`primus.core.run.rundir.hold`: refused, naming the holder, while
    another run writes there), then check it again under the lock (:func:`check_output_dir`). The lock's fd."""
    fd = hold(output_dir(cfg))
    try:
        check_output_dir(cfg, resume)
    except BaseException:
        release(output_dir(cfg))
        raise
    return fd


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def rank_context(
    res: Resolved, resume: bool = False, write_config: bool = True, evaluate: bool = False
) -> tuple[PrimusConfig, RunContext]:
    """This rank's side of a run before the engine: data refusals (before anything is written), the evaluation
    samples (with ``eval.interval`` or ``evaluate``), kernels, the run's facts (:class:`RunInfo`), the run folder
    with its ``config.yaml`` (``write_config``)."""
    from primus.core.data.checks import check_data

    check_data(res.config)  # every data refusal comes before anything is written (the run folder included)
    eval_samples = None
    if evaluate or res.config.eval.interval:
        from primus.core.data.splits import eval_samples as build_eval_samples

        eval_samples = build_eval_samples(res.config)  # too few: refused now, before the run folder

    from primus.core.kernels import detect_device, select_kernels
    from primus.core.planner.modelmath import count_params, flops_per_token
    from primus.core.run.metrics import peak_flops

    cfg, registry = res.config, res.registry
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if rank != 0 and cfg.logging.level != "debug":  # one voice: the other ranks (and their engines) warn only
        logging.getLogger().setLevel(logging.WARNING)
    device = detect_device()
    from primus.core.run.lazy_compile import defer_torch_compile

    # before the engine's import: its compiled functions cost nothing until they run, and on a CPU they run eager
    defer_torch_compile(eager=device == "cpu")
    device_name = None
    if device != "cpu":
        from primus.core.planner.auto import check_fits

        check_fits(cfg, res.world_size, registry=registry)  # a layout that cannot fit: refused before any build
        import torch

        device_name = torch.cuda.get_device_name(local_rank)
    kernels = select_kernels(
        cfg.kernels,
        registry,
        device,
        documents=cfg.data.document_mask,
        moe=cfg.model.moe is not None,
        head_dim=cfg.model.kv_channels,
        dtype=cfg.train.precision,
        cp=cfg.parallel.cp,
    )
    out = output_dir(cfg)
    if cfg.train.init_from:  # a checkpoint of the other engine becomes a Hugging Face folder, once
        from primus.core.run.health import collective_timeout
        from primus.core.run.init_from import prepare

        cfg = prepare(cfg, rank, out, collective_timeout(cfg.train.health).total_seconds())
    info = RunInfo(
        world_size=res.world_size,
        rank=rank,
        local_rank=local_rank,
        device=device,
        backend=cfg.backend.name,
        output_dir=str(out),
        kernels={op: k.name for op, k in kernels.items()},
        num_params=count_params(cfg.model).total,
        flops_per_token=flops_per_token(cfg.model, cfg.train.seq_len),
        peak_flops=peak_flops(device_name),
        extra={"device_name": device_name or "cpu"},
    )
    if rank == 0 and write_config:
        if not os.environ.get(LOCK_HELD_ENV):  # (core's launcher holds it for the whole job)
            claim_output_dir(cfg, resume)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        log.info("kernels: %s", ", ".join(f"{op}={name}" for op, name in info.kernels.items()))
    hooks = registry.pm.hook
    ctx = RunContext(
        info=info,
        hooks=hooks,
        kernels=kernels,
        resume=bool(resume or cfg.checkpoint.resume),
        config=cfg,
        eval_samples=eval_samples,
    )
    return cfg, ctx


def run_rank(res: Resolved, resume: bool = False) -> dict[str, Any]:
    """Train on this rank (called once per process)."""
    try:
        cfg, ctx = rank_context(res, resume)
    except BaseException:
        release(output_dir(res.config))
        raise
    hooks, info = ctx.hooks, ctx.info
    backend = res.registry.backends[cfg.backend.name]
    summary: dict[str, Any] = {"status": "failed"}
    try:
        from primus.core.run.loop import train

        summary = train(cfg, ctx, backend)  # core's loop drives the backend's engine (it calls on_train_start)
        summary.setdefault("status", "ok")
        return summary
    except BaseException as exc:
        summary = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        raise
    finally:
        try:
            hooks.primus_on_train_end(summary=summary, info=info)
        finally:
            release(output_dir(cfg))


def eval_rank(res: Resolved, checkpoint: Path) -> dict[str, Any]:
    """Evaluate a checkpoint on this rank (``primus eval``): no training hooks, nothing written but the engine's
    scratch files under the run folder."""
    from primus.core.run.loop import evaluate_checkpoint

    cfg, ctx = rank_context(res, write_config=False, evaluate=True)
    return evaluate_checkpoint(cfg, ctx, res.registry.backends[cfg.backend.name], checkpoint)


def torchrun_command(
    argv: list[str],
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    rdzv: str | None = None,
) -> list[str]:
    # torchrun, its failure report made one line (primus.core.launch.torchrun; the same arguments as torch.distributed.run)
    cmd = [
        sys.executable,
        "-m",
        "primus.core.launch.torchrun",
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
    ]
    if rdzv:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}"]
    else:
        cmd += [f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}"]
    return [*cmd, "-m", "primus.core.cli.app", *argv]


#: torchrun forwards these to its workers (SIGUSR1: what Slurm sends before a time limit or preemption) and waits
#: this long for them to commit their checkpoint before it kills them (torchrun reads its options from PET_*).
TORCHRUN_ENV = {"PET_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS, "PET_SHUTDOWN_TIMEOUT": "600"}


_ANSI = re.compile(rb"\x1b\[[0-9;]*m")
_RANK_LINE = re.compile(rb"^\[rank(\d+)\]: ")  # torch prints a worker's uncaught exception with this prefix
_MAYBE_RANK_LINE = re.compile(rb"(\[(r(a(n(k(\d+(\](:)?)?)?)?)?)?)?)?")  # a start that may still become one


class _StderrFilter:
    """Copies torchrun's stderr (its workers' too) to ``dst`` as it comes, a line at a time once its start says what
    it is (so a progress bar still draws): shown, but for a worker's uncaught exception (lines ``[rankN]: ...``,
    kept per rank: after a rank is killed the others die of the lost connection) and
    :data:`primus.core.launch.torchrun.MARK`'s report (kept in :attr:`report`). Keeps the ``error:`` lines the workers
    printed (a run that failed saying why, in one line)."""

    def __init__(self, dst: Any) -> None:
        from primus.core.launch.torchrun import MARK

        self.dst, self.mark = dst, MARK.encode()
        self.report: dict[str, Any] | None = None
        self.errors: list[bytes] = []
        self.tracebacks: dict[int, list[bytes]] = {}
        self._line, self._mode = b"", None  # mode None: undecided, else "pass", "drop" or "mark"

    def feed(self, chunk: bytes) -> None:
        while chunk:
            end = chunk.find(b"\n")
            part, chunk = (chunk, b"") if end < 0 else (chunk[: end + 1], chunk[end + 1 :])
            self._line += part
            if self._mode is None:
                self._decide(complete=end >= 0)
                if self._mode == "pass":
                    self.dst.write(self._line)
            elif self._mode == "pass":
                self.dst.write(part)
                self._line = self._line[:256]  # enough to tell an error: line; a progress bar may never end one
            if end >= 0:
                self._end_line()
        self.dst.flush()

    def _decide(self, complete: bool) -> None:
        body = _ANSI.sub(b"", self._line).rstrip(b"\n")
        if body.startswith(self.mark[:1]):
            self._mode = "mark"
        elif _RANK_LINE.match(body):
            self._mode = "drop"
        elif body.startswith(b"error:") or b"error:".startswith(body):  # held whole: each rank may say the same
            if complete:
                self._mode = "drop" if body in self.errors else "pass"
        elif complete or not _MAYBE_RANK_LINE.fullmatch(body):
            self._mode = "pass"

    def _end_line(self) -> None:
        body = _ANSI.sub(b"", self._line).rstrip(b"\n")
        if self._mode == "mark":
            import json

            self.report = json.loads(body[len(self.mark) :])
        elif self._mode == "drop" and (m := _RANK_LINE.match(body)):
            self.tracebacks.setdefault(int(m.group(1)), []).append(self._line)
        elif body.startswith(b"error:") and body not in self.errors:
            self.errors.append(body)
        self._line, self._mode = b"", None

    def flush(self) -> None:
        if self._line:
            self.feed(b"\n")


def launch_torchrun(argv: list[str], output: Path | None = None, keep_fd: int | None = None, **kw: Any) -> int:
    """Run torchrun in its own session and pass it the stop signals once (a signal to the whole process group
    would reach it twice). Returns its exit code: :data:`primus.core.run.stop.PREEMPTED_EXIT` when the workers stopped
    early with a checkpoint (``output``'s summary says so), or when a stop signal ended the job before its first
    step; 2 when a worker refused the run (a user's mistake: its one-line error shown); else the failed worker's,
    said in one line (its rank, pid, signal and the exit code; ``128 + N`` for signal ``N``) unless the worker said
    why itself. Neither torchrun's traceback nor a worker's reaches the user, but for a worker that failed first
    without a word (a bug: its traceback is shown). ``keep_fd``: a file descriptor torchrun inherits (the output
    folder's lock, held as long as the job lives)."""
    import json
    import signal
    import threading

    from primus.core.run.stop import PREEMPTED_EXIT, SIGNALS

    cmd = torchrun_command(argv, **kw)
    log.info("launching: %s", shlex.join(cmd))
    env = {**TORCHRUN_ENV, **os.environ, LAUNCHED_ENV: "1"}
    if kw.get("nproc_per_node", 1) > 1:  # torchrun's own default for several workers, without its 5-line banner
        env.setdefault("OMP_NUM_THREADS", "1")
    if sys.stderr.isatty():  # the workers write through a pipe: keep rich's terminal output (progress bar)
        env.update({"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"})
    started = time.time()
    received: list[int] = []
    procs: list[subprocess.Popen] = []

    def forward(num: int, _frame: Any) -> None:
        received.append(num)
        for proc in procs:
            proc.send_signal(num)

    forwarded = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    previous = {num: signal.signal(num, forward) for num in forwarded}
    try:
        proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, stderr=subprocess.PIPE, pass_fds=(keep_fd,) if keep_fd else ()
        )
        procs.append(proc)
        for num in received:  # arrived while torchrun started
            proc.send_signal(num)
        filt = _StderrFilter(sys.stderr.buffer)

        def pump() -> None:
            while chunk := os.read(proc.stderr.fileno(), 1 << 16):
                filt.feed(chunk)
            filt.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        rc = proc.wait()
        reader.join()
    finally:
        for num, handler in previous.items():
            signal.signal(num, handler)
    status = None
    if output is not None:  # a worker may leave with 0 after its early stop (torchrun then returns 0)
        summary = output / "summary.json"
        try:  # this launch's summary, not an earlier run's in the same folder
            fresh = summary.stat().st_mtime >= started
            status = json.loads(summary.read_text()).get("status") if fresh else None
        except (OSError, ValueError):
            status = None
    if status == "preempted":
        return PREEMPTED_EXIT
    report = filt.report
    if not rc or report is None:
        return rc
    stop = next((signal.Signals(n).name for n in received if signal.Signals(n).name in SIGNALS), None)
    if report.get("launcher") or report.get("exitcode") == PREEMPTED_EXIT:
        if stop and status != "failed" and not filt.errors:  # stopped before the loop could save: nothing lost
            _say(f"stopped by {stop} before the first step: nothing to save; the same command starts the run again", "")
            return PREEMPTED_EXIT
        if not filt.errors:
            _say(f"the run was stopped by {report['signal']} (exit code {rc})")
        return rc
    if report["exitcode"] == 2:  # a refusal, said by the worker in one line
        return 2
    if filt.errors:  # the worker said why (e.g. a full disk); the others died of the lost connection
        return rc
    rank, pid = report["rank"], report["pid"]
    if report["signal"]:
        _say(f"rank {rank} (pid {pid}) was killed by {report['signal']}; the job stopped (exit code {rc})")
    else:
        sys.stderr.buffer.write(b"".join(filt.tracebacks.get(rank, [])) + b"\n")  # a bug: its traceback
        _say(f"rank {rank} (pid {pid}) failed with exit code {report['exitcode']}; the job stopped (exit code {rc})")
    return rc


def _say(message: str, prefix: str = "error: ") -> None:
    from rich.console import Console  # the CLI's stderr console, made here: cli_helpers imports this module

    Console(stderr=True, soft_wrap=True).print(
        f"{prefix}{message}", style="red" if prefix else "yellow", highlight=False, markup=False
    )
