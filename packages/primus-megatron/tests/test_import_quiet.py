"""megatron-core's FSDP modules announce "using Megatron-FSDP" when imported; the engine's import keeps them quiet,
so a run without parallel.fsdp never says it uses FSDP."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_engine_does_not_announce_megatron_fsdp():
    code = (
        "import logging; logging.basicConfig(level=logging.INFO); import primus.megatron.engine; "
        "import megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp; print('imported')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-2000:]
    assert "Megatron-FSDP" not in proc.stderr
