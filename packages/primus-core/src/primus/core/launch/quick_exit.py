"""Leave a ``primus`` process without the interpreter's teardown.

Once torch and an engine are imported, Python's own exit (clearing thousands of modules and their objects one by
one) costs about a second of CPU per process, after the run has ended and reported: measured 0.75 s of a 4.6 s
one-rank Megatron run on CPU, in every rank, launcher and torchrun process. :func:`quick_exit` does what a
normal exit must (first what the interpreter's own exit does first, ``threading._shutdown``: the threads' exit
hooks, then waiting for every thread that is not a daemon, an asynchronous checkpoint save say; the atexit
handlers, where torch, the loggers and multiprocessing finish; the logging handlers' flush; the standard streams)
and skips the rest with :func:`os._exit`. It is also what keeps a multi-rank gloo job from aborting in the
teardown ("terminate called without an active exception", about one exit in ten, after the work is done).

The exit code is the one asked for, whatever an atexit handler does: one that leaves with ``os._exit`` itself
(a backend's quiet exit once did, with 0, and a rank that had failed on a full disk left with 0).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import threading
from typing import NoReturn


def exit_code(code: object) -> int:
    """``SystemExit.code`` as a process exit status (None: 0; a message: printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def others_running() -> list[threading.Thread]:
    """Threads, other than this one, that a normal exit would wait for."""
    me = threading.current_thread()
    return [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]


def quick_exit(code: int) -> NoReturn:
    shutdown = getattr(threading, "_shutdown", None)  # CPython's; elsewhere the normal exit, which waits
    if others_running():
        if shutdown is None:
            sys.exit(code)
        shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    gc.collect()  # objects in cycles that hold files: their finalizers flush them
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(code)
