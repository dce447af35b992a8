"""hipBLASLt's own offline tuning (ROCm), driven through its tools; selected only where ``hipblaslt-bench`` is on
PATH. Three stages (hipBLASLt docs, "offline tuning"):

1. dump: run training with :func:`dump_env` (``HIPBLASLT_LOG_MASK=32``): hipBLASLt logs every GEMM it runs as a
   ``hipblaslt-bench`` command line;
2. tune: :func:`tuning_commands` turns the unique logged lines into search runs (``--requested_solution -1``: all
   solutions; the fixed ``--algo_method index --solution_index N`` dropped), run with
   ``HIPBLASLT_TUNING_FILE`` (:func:`tune_env`) so hipBLASLt writes the winners there;
3. apply: train with :func:`override_env` (``HIPBLASLT_TUNING_OVERRIDE_FILE``).

:func:`bench_command` writes the command for a recorded :class:`GemmShape` directly (BLAS column-major terms).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from primus.tune.shapes import GemmShape

TOOL = "hipblaslt-bench"

# hipblaslt-bench precision names
BENCH_TYPES = {
    "bfloat16": "bf16_r",
    "float16": "f16_r",
    "float32": "f32_r",
    "float8_e4m3fn": "f8_r",
    "float8_e5m2": "bf8_r",
    "float8_e4m3fnuz": "f8_fnuz_r",
    "float8_e5m2fnuz": "bf8_fnuz_r",
}
# flags of a logged line that pin one solution (or a timing setup) and are replaced when tuning
_PINNED = {"--algo_method", "--solution_index", "--requested_solution", "--iters", "-i", "--cold_iters", "-j"}
_PINNED_BARE = {"--print_kernel_info", "--flush"}


def bench_tool() -> str | None:
    """The path of ``hipblaslt-bench``, or None where it is not installed (then this path is not offered)."""
    return shutil.which(TOOL)


def dump_env(log_file: str | Path) -> dict[str, str]:
    """Environment for a training run that logs its GEMMs as bench commands (``%i`` in the name becomes the pid)."""
    return {"HIPBLASLT_LOG_MASK": "32", "HIPBLASLT_LOG_FILE": str(log_file)}


def tune_env(tuning_file: str | Path) -> dict[str, str]:
    return {"HIPBLASLT_TUNING_FILE": str(tuning_file)}


def override_env(tuning_file: str | Path) -> dict[str, str]:
    return {"HIPBLASLT_TUNING_OVERRIDE_FILE": str(tuning_file)}


def logged_commands(lines: Iterable[str]) -> list[list[str]]:
    """The unique ``hipblaslt-bench`` command lines of a ``HIPBLASLT_LOG_MASK=32`` log, in first-seen order."""
    seen: dict[str, list[str]] = {}
    for line in lines:
        line = line.strip()
        start = line.find(TOOL)
        if start < 0:
            continue
        argv = shlex.split(line[start:])
        seen.setdefault(" ".join(argv), argv)
    return list(seen.values())


def tuning_command(
    logged: list[str],
    *,
    iters: int = 20,
    cold_iters: int = 20,
    rotating_mb: int = 512,
    skip_slow_solution_ratio: float = 0.7,
    tool: str = TOOL,
) -> list[str]:
    """A logged bench line turned into a search over all solutions (Primus's offline_tune_gemm.py settings)."""
    out: list[str] = [tool]
    args = logged[1:]
    i = 0
    while i < len(args):
        flag = args[i]
        if flag in _PINNED:
            i += 2
            continue
        if flag in _PINNED_BARE or flag == "--rotating":
            i += 1 if flag in _PINNED_BARE else 2
            continue
        out.append(flag)
        i += 1
    out += [
        "--requested_solution",
        "-1",
        "--skip_slow_solution_ratio",
        str(skip_slow_solution_ratio),
        "--rotating",
        str(rotating_mb),
        "--cold_iters",
        str(cold_iters),
        "--iters",
        str(iters),
        "--print_kernel_info",
    ]
    return out


def tuning_commands(log_lines: Iterable[str], **kw) -> list[list[str]]:
    return [tuning_command(argv, **kw) for argv in logged_commands(log_lines)]


def bench_command(shape: GemmShape, *, tool: str = TOOL) -> list[str]:
    """The search command for one recorded GEMM. torch hands BLAS ``out.T = b.T @ a.T`` (column-major), so
    BLAS's A is torch's b: ``transA`` is b's layout, ``m`` is torch's n (:meth:`GemmShape.blas`)."""
    if shape.dtype not in BENCH_TYPES or shape.out_dtype not in BENCH_TYPES:
        raise ValueError(f"{shape.key}: no hipblaslt-bench type for {shape.dtype} -> {shape.out_dtype}")
    blas = shape.blas()
    a_type = BENCH_TYPES[shape.b_dtype or shape.dtype]  # BLAS A is torch's b
    b_type = BENCH_TYPES[shape.dtype]
    d_type = BENCH_TYPES[shape.out_dtype]
    cmd = [
        tool,
        "--api_method",
        "c",
        "-m",
        str(blas["m"]),
        "-n",
        str(blas["n"]),
        "-k",
        str(blas["k"]),
        "--transA",
        blas["transa"],
        "--transB",
        blas["transb"],
        "--a_type",
        a_type,
        "--b_type",
        b_type,
        "--c_type",
        d_type,
        "--d_type",
        d_type,
        "--compute_type",
        "f32_r",
    ]
    if shape.batch != 1:
        cmd += ["--batch_count", str(shape.batch)]
    if shape.bias:
        cmd += ["--bias_vector", "--bias_type", d_type]
    if shape.op == "scaled_mm":
        cmd += ["--scaleA", "1", "--scaleB", "1"]
    return cmd


def run_tuning(commands: list[list[str]], tuning_file: str | Path, env: dict[str, str] | None = None) -> Path:
    """Run the search commands with ``HIPBLASLT_TUNING_FILE``; hipBLASLt appends each winner to the file."""
    import os

    if bench_tool() is None:
        raise FileNotFoundError(f"{TOOL} is not on PATH (it ships with ROCm's hipBLASLt clients)")
    full_env = {**os.environ, **(env or {}), **tune_env(tuning_file)}
    for cmd in commands:
        subprocess.run(cmd, env=full_env, check=True)
    return Path(tuning_file)
