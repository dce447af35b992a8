"""``python -m primus.core.launch.torchrun ARGS``: torchrun (``torch.distributed.run``, the same arguments) as core's
launcher runs it, with its failure report turned into one line for the launcher.

torchrun ends a failed job by raising: ``ChildFailedError`` (a worker failed: its traceback and a table) or
``SignalException`` (torchrun itself was signalled). Here both end in one :data:`MARK` line on stderr, a JSON
object (``rank``, ``pid``, ``exitcode``, ``signal``), which :func:`primus.core.launch.launcher.launch_torchrun` reads (and
never shows) to say what happened in one line; the exit code is the failed worker's (``128 + N`` for a worker
killed by signal ``N``, as a shell reports it)."""

from __future__ import annotations

import json
import logging
import signal
import sys

MARK = "\x1eprimus-torchrun "


def _report(**what: object) -> None:
    sys.stderr.write(MARK + json.dumps(what) + "\n")
    sys.stderr.flush()


def root_cause(failures: dict) -> tuple[int, object]:
    """The failure that ended the job, of torchrun's ``{rank: ProcessFailure}``. torchrun's own choice (the earliest)
    counts in whole seconds, so a rank killed by a signal and a rank that died of the lost connection tie; of those
    within a second of the first: a rank killed by a signal other than the SIGTERM torchrun stops the others with,
    then a refusal (exit 2) or a rank out of memory (:data:`~primus.core.run.oom.OOM_EXIT`: the others die of the lost
    connection, with exit 1), then a rank that exited with a code of its own (a full disk's 1) before one torchrun
    stopped, then the lowest rank."""
    from primus.core.run.oom import OOM_EXIT

    first = min(f.timestamp for f in failures.values())

    def order(item: tuple) -> tuple:
        rank, f = item
        stopped = f.exitcode == -signal.SIGTERM
        return (not (f.exitcode < 0 and not stopped), f.exitcode not in (2, OOM_EXIT), stopped, rank)

    return min(((r, f) for r, f in failures.items() if f.timestamp <= first + 1), key=order)


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun's own log lines about the failure (the closing signals, "failed (exitcode ...)") are what MARK says
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = root_cause(exc.failures)
        code = failure.exitcode
        name = failure.signal_name() if code < 0 else None
        _report(rank=rank, pid=failure.pid, exitcode=code, signal=name)
        return 128 - code if code < 0 else code
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        _report(rank=None, pid=None, exitcode=None, signal=name, launcher=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    from primus.core.launch.quick_exit import quick_exit

    quick_exit(main(sys.argv[1:]))
