"""Why primus-turbo's FP8 linear loses its gradients under torch.compile on CUDA (y right, dx/dw wrong):
each piece compiled alone vs eager; the linear under dynamo alone (backend ``eager``), ``aot_eager`` and
inductor, with e5m2 and e4m3 gradients; then the autograd function applied directly (no autocast region, a
cloned output, the PyTorch quantizer named). Prints one line per probe; a debugging aid, not a benchmark."""

import sys
from pathlib import Path

import torch

from primus.turbo.fp8 import linear
from primus.turbo.fp8.quantize import quantize_torch
from primus.turbo.fp8.recipe import Fp8Recipe

sys.path.insert(0, str(Path(__file__).parents[1]))
from _common import rel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


g = torch.Generator(device=DEV).manual_seed(0)
x0 = torch.randn(2048, 1024, device=DEV, generator=g).bfloat16()
w0 = torch.randn(768, 1024, device=DEV, generator=g) / 32
dy = torch.randn(2048, 768, device=DEV, generator=g).bfloat16()

for fmt in ("e4m3", "e5m2"):
    e = quantize_torch(dy, fmt, rowwise=False)
    c = torch.compile(lambda t, f=fmt: quantize_torch(t, f, rowwise=False), fullgraph=True)(dy)
    same = (e.data.view(torch.uint8) == c.data.view(torch.uint8)).float().mean().item()
    print(
        f"quantize {fmt}: bytes equal {same:.4f}, scale_inv eager {e.scale_inv.item():.3e} compiled {c.scale_inv.item():.3e}"
    )


def run(backend, recipe, compiled=True):
    torch._dynamo.reset()
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()

    def f(a, b):
        return linear.fp8_linear(a, b, recipe=recipe)

    y = (torch.compile(f, fullgraph=True, backend=backend) if compiled else f)(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


for name, recipe in (("e5m2 grads", Fp8Recipe()), ("e4m3 grads", Fp8Recipe(grad_dtype="e4m3"))):
    ref = run(None, recipe, compiled=False)
    for backend in ("eager", "aot_eager", "inductor"):
        try:
            out = run(backend, recipe)
            diffs = {k: round(rel(a, b), 4) for k, a, b in zip(("y", "dx", "dw"), out, ref, strict=True)}
            print(f"{name} backend {backend}: rel diff vs eager {diffs}; |dx| {out[1].float().norm().item():.3e}")
        except Exception as exc:  # noqa: BLE001
            print(f"{name} backend {backend}: {type(exc).__name__}: {str(exc)[:300]}")


# probes of the cause: the autograd function applied without fp8_linear's autocast-off region, and with its
# output passed through a clone (an output that aliases nothing)
def direct(a, b, recipe=Fp8Recipe(), clone=False, impl="auto"):  # noqa: B008 - a frozen dataclass
    y = linear._Fp8Linear.apply(a, b, recipe, None, impl, a.dtype)
    return y.clone() if clone else y


ref = run(None, Fp8Recipe(), compiled=False)
probes = {
    "no autocast region": direct,
    "no autocast region, clone": lambda a, b: direct(a, b, clone=True),
    "no autocast region, impl torch": lambda a, b: direct(a, b, impl="torch"),
}
for name, fn in probes.items():
    torch._dynamo.reset()
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    try:
        y = torch.compile(fn, fullgraph=True, backend="eager")(x, w)
        y.backward(dy)
        print(f"{name}: dx rel diff {rel(x.grad, ref[1]):.4f}, dw rel diff {rel(w.grad, ref[2]):.4f}")
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
