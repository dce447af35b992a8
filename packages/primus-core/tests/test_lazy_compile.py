"""primus.core.run.lazy_compile: torch.compile of a function is deferred to its first call, with torch.compile's result.

Run in a fresh interpreter: the deferral replaces ``torch.compile`` for the process, and whether TorchDynamo has
been imported is the point."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from primus.core.run.lazy_compile import defer_torch_compile

    defer_torch_compile()
    defer_torch_compile()  # idempotent: one layer of deferral
    assert torch.compile.__wrapped__.__module__ == "torch", torch.compile.__wrapped__

    def gelu_bias(x, b):
        return torch.nn.functional.gelu(x + b)

    plain = torch.compile(gelu_bias, backend="eager")

    @torch.compile(backend="eager", fullgraph=True)
    def decorated(x):
        return x * 2

    print("deferred", "torch._dynamo.eval_frame" not in sys.modules)
    print("kwargs", plain._primus_compile_kwargs)
    x, b = torch.randn(4, 3), torch.randn(3)
    print("equal", torch.equal(plain(x, b), gelu_bias(x, b)), torch.equal(decorated(x), x * 2))
    print("compiled", "torch._dynamo.eval_frame" in sys.modules)  # the first call compiled with torch.compile
    module = torch.compile(torch.nn.Linear(3, 3), backend="eager")
    print("module", type(module).__name__)

    # called inside a region Dynamo traces, the deferred function is inlined like a compiled one (no graph break)
    fresh = torch.compile(gelu_bias, backend="eager")  # not called yet: its first call is inside the trace
    outer = torch.compile(lambda x: fresh(x, b) + 1, backend="eager", fullgraph=True)
    print("inlined", torch.equal(outer(x), gelu_bias(x, b) + 1))
    """
)


def test_compile_is_deferred_to_the_first_call_and_gives_torch_compiles_result():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["deferred"] == "True"  # TorchDynamo is not imported by compiling a function
    assert lines["module"] == "OptimizedModule"  # a module is compiled at once, as callers expect
    assert lines["kwargs"] == "{'backend': 'eager'}"
    assert lines["equal"] == "True True"
    assert lines["compiled"] == "True"  # the first call compiled with torch.compile
    assert lines["inlined"] == "True"


EAGER = textwrap.dedent(
    """
    import sys
    import torch
    from primus.core.run.lazy_compile import defer_torch_compile

    defer_torch_compile(eager=True)

    @torch.compile(fullgraph=True)
    def scaled(x):
        return x * 2

    x = torch.randn(4)
    print(torch.equal(scaled(x), x * 2), "torch._dynamo.eval_frame" in sys.modules)
    """
)


def test_on_a_cpu_compiled_functions_run_as_written():
    """defer_torch_compile(eager=True), what a CPU run installs: a compiled function's calls run it as written,
    TorchDynamo never imported for it."""
    out = subprocess.run([sys.executable, "-c", EAGER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
