"""Core's own plugin: base presets, plain-PyTorch kernels, built-in strategies, run loggers.

Registered like any other plugin (entry point ``core`` of group ``primus``), so defaults are just
the lowest-ranked contributions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from primus.core import hookimpl
from primus.core.contracts.protocols import DOCUMENTS, KERNEL_OPS, KernelProvider

PRESETS_DIR = Path(__file__).parent / "presets"

_REF = "primus.core.kernels.reference"


@hookimpl
def primus_presets() -> list[Path]:
    return [PRESETS_DIR]


@hookimpl
def primus_kernels() -> list[KernelProvider]:
    desc = {
        "attention": "torch SDPA (cuDNN/flash/efficient on GPU, math on CPU)",
        "grouped_gemm": "a matmul per expert (plain PyTorch reference)",
        "moe_permute": "index copies by a stable sort of the experts (plain PyTorch reference)",
        "moe_router": "softmax / sigmoid, topk and gather (plain PyTorch reference)",
    }
    return [
        KernelProvider(
            op=op,
            name="sdpa" if op == "attention" else "torch",
            impl=f"{_REF}:{op}",
            available=f"{_REF}:always",
            priority=0,
            description=desc.get(op, "plain PyTorch reference"),
            features=frozenset({DOCUMENTS}) if op == "attention" else frozenset(),
        )
        for op in KERNEL_OPS
        if op != "gemm"  # FP8 linears: providers of their own (primus-turbo, torchao)
    ]


@hookimpl
def primus_strategies() -> list[Any]:
    from primus.core.planner.strategies import BUILTIN_STRATEGIES

    return BUILTIN_STRATEGIES


@hookimpl
def primus_on_train_start(config: Any, info: Any) -> None:
    from primus.core.run import runlog

    runlog.start(config, info)


@hookimpl
def primus_on_optimizer_step(step: int, info: Any) -> None:
    from primus.core.run import runlog

    runlog.advance(step)


@hookimpl
def primus_on_log(step: int, metrics: dict[str, float], info: Any) -> None:
    from primus.core.run import runlog

    runlog.step(step, metrics, info)


@hookimpl
def primus_on_train_end(summary: dict[str, Any], info: Any) -> None:
    from primus.core.run import runlog

    runlog.end(summary, info)
