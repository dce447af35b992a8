"""``primus`` (core's CLI) with primus-turbo's Triton providers counted as available on the CPU: run with
``TRITON_INTERPRET=1`` they execute in Triton's interpreter (the real kernels, numpy-backed).

Usage: ``python turbo_on_cpu.py train CONFIG overrides...`` (world size 1).
"""

from __future__ import annotations

import sys

import primus.turbo.availability as availability
from primus.core.contracts.protocols import Availability

if __name__ == "__main__":
    availability.triton_kernels = lambda device, **_: Availability(True)
    from primus.core.cli.app import entry

    sys.argv = ["primus", *sys.argv[1:]]
    entry()  # as the primus command: out without the interpreter's teardown (a gloo job aborts in it at times)
