"""``torch.compile`` of a function, deferred to the function's first call.

Both engines compile functions with ``torch.compile`` as their modules are imported (Megatron-Core's ``jit_fuser``
fusions, TorchTitan's attention wrappers). ``torch.compile`` is lazy already (it traces and compiles on the first
call), but its first use imports TorchDynamo and Inductor: 2-3 s of every rank's start, paid even when no compiled
function ever runs (a CPU run calls none of them). Deferred, the import happens on the first call of a compiled
function, and the result of each call is torch.compile's own. Modules (``torch.compile(model)``) are not deferred:
callers keep the ``OptimizedModule`` they expect.

On a machine without an accelerator (``eager=True``) such functions are not compiled at all: Inductor's C++ build of
one small fusion (megatron's router expert-bias update, the first time DeepSeek's router runs) took 3.5 s of an
8.3 s one-rank CPU run, and a CPU run is too small for a fusion to pay back; the eager function is the reference
the compiled one approximates.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

_installed = threading.Lock()


def defer_torch_compile(*, eager: bool = False) -> None:
    """Make ``torch.compile(fn, ...)`` of a plain function (also as a decorator) return a wrapper that compiles
    ``fn`` with the real ``torch.compile`` and the same arguments on its first call (``eager``: ``fn`` itself, never
    compiled). Idempotent (the first call's ``eager`` stays); call it before the engine's modules are
    imported (a module imported earlier keeps what it compiled then)."""
    import torch

    with _installed:
        if getattr(torch.compile, "_primus_deferred", False):
            return
        torch.compile = _deferring(torch.compile, eager)


def _deferring(compile_: Callable[..., Any], eager: bool) -> Callable[..., Any]:
    @functools.wraps(compile_)
    def compile(model: Any = None, **kwargs: Any) -> Any:
        import torch

        if model is None:  # @torch.compile(mode=...): the decorator, deferred the same way
            return lambda fn: compile(fn, **kwargs)
        if isinstance(model, torch.nn.Module) or not callable(model):
            return compile_(model, **kwargs)
        return model if eager else _deferred(compile_, model, kwargs)

    compile._primus_deferred = True  # type: ignore[attr-defined]
    return compile


def _deferred(compile_: Callable[..., Any], fn: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    compiled: list[Callable[..., Any]] = []
    lock = threading.Lock()

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        if not compiled:
            with lock:
                if not compiled:
                    compiled.append(compile_(fn, **kwargs))
        return compiled[0](*args, **kw)

    # Inside a region TorchDynamo is tracing, the wrapper is the function itself, as a compiled one is: Dynamo
    # inlines ``_torchdynamo_inline`` (no graph break on the lock), and a compile of the wrapper compiles ``fn``.
    call._torchdynamo_inline = fn  # type: ignore[attr-defined]
    call._torchdynamo_orig_callable = fn  # type: ignore[attr-defined]
    call._primus_compile_kwargs = kwargs  # type: ignore[attr-defined]  (what the first call compiles with)
    return call
