"""FP8 linears under torch.compile, on the GPU: one training step of a small torchtitan Llama with its blocks
compiled the way torchtitan compiles them (``torch.compile(block, fullgraph=True)``), against the same model
in eager mode and against fp32. Every parameter's gradient must exist and carry the error eager FP8 has.

    python3 benchmarks/fp8_compile_check.py --out benchmarks/results/fp8_compile_check.json

Cases: fp32 (reference), bf16 autocast, primus-turbo FP8 tensorwise eager / compiled, torchao FP8 tensorwise
eager / compiled (where torchao is installed). Per case: loss, relative error of the loss and of each
gradient group (block linears, norms, embedding, output) vs fp32, and the names of parameters left without a
gradient. Then ``--steps`` AdamW steps of each FP8 case from the same start on one fixed batch (memorising
it): the loss must fall as bf16's does. Exits 1 unless primus-turbo's compiled FP8 case has every gradient,
at most 1.5x its eager twin's gradient error, and a falling loss (a gate before compiled FP8 throughput runs).
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import traceback
from pathlib import Path

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke check of the script only

sys.path.insert(0, str(Path(__file__).parent))
from _common import rel, versions  # noqa: E402


def build(args: argparse.Namespace) -> torch.nn.Module:
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    margs = TransformerModelArgs(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.dim // 64,
        n_kv_heads=args.dim // 256,
        vocab_size=args.vocab,
        multiple_of=256,
        max_seq_len=args.seq,
    )
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Transformer(margs)
    with torch.no_grad():
        model.init_weights()
    return model


def convert(model: torch.nn.Module, impl: str) -> None:
    from primus.turbo.fp8.recipe import Fp8Recipe

    skip = lambda name, module: name == "output"  # noqa: E731 - the recipe's default: output head in bf16
    if impl == "torchao":
        from primus.turbo.fp8.torchao_backend import convert_to_fp8
    else:
        from primus.turbo.fp8.linear import convert_to_fp8
    convert_to_fp8(model, Fp8Recipe(), skip)


def compile_blocks(model: torch.nn.Module) -> None:
    for name, block in model.layers.named_children():  # as torchtitan's apply_compile
        model.layers.register_module(name, torch.compile(block, fullgraph=True))


def loss_of(model, tokens, labels, autocast: bool) -> torch.Tensor:
    with torch.autocast(DEV, dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def group(name: str) -> str:
    if name.startswith("tok_embeddings"):
        return "embedding"
    if name.startswith("output"):
        return "output"
    return "norms" if "norm" in name else "block_linears"


def grads(model) -> dict[str, torch.Tensor | None]:
    return {n.replace("._orig_mod", ""): p.grad for n, p in model.named_parameters()}


def rel_by_group(g: dict, ref: dict) -> dict[str, float]:
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for n, r in ref.items():
        if g.get(n) is None:
            continue
        k = group(n)
        num[k] = num.get(k, 0.0) + (g[n].float() - r.float()).square().sum().item()
        den[k] = den.get(k, 0.0) + r.float().square().sum().item()
    return {k: (num[k] / den[k]) ** 0.5 for k in num}


def single_linear(result: dict) -> None:
    """One FP8 linear, compiled vs eager: with the GEMM as primus-turbo's opaque op (what the linear uses), and
    with ``torch._scaled_mm`` inline on the transposed copies (what it used before; inductor then chooses
    their layout) - which of the two the compiled gradients need."""
    from primus.turbo.fp8 import linear
    from primus.turbo.fp8.recipe import Fp8Recipe

    def inline(a, b, scale_a, scale_b, out_dtype, fast_accum):
        return torch._scaled_mm(
            a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum
        )

    opaque = linear.scaled_mm
    sec = result.setdefault("single_linear", {})
    g = torch.Generator(device=DEV).manual_seed(0)
    x0 = torch.randn(2048, 1024, device=DEV, generator=g).bfloat16()
    w0 = torch.randn(768, 1024, device=DEV, generator=g) / 32
    dy = torch.randn(2048, 768, device=DEV, generator=g).bfloat16()
    for gemm, fn in (("opaque", opaque), ("inline", inline)):
        for mode in ("tensorwise", "rowwise"):
            linear.scaled_mm = fn
            try:
                outs, recipe = [], Fp8Recipe(mode=mode)
                for compiled in (False, True):
                    torch._dynamo.reset()
                    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                    f = lambda a, b, r=recipe: linear.fp8_linear(a, b, recipe=r)  # noqa: E731
                    y = (torch.compile(f, fullgraph=True) if compiled else f)(x, w)
                    y.backward(dy)
                    outs.append((y.detach(), x.grad, w.grad))
                sec[f"{gemm}/{mode}"] = {
                    k: rel(c, e) for k, c, e in zip(("y", "dx", "dw"), outs[1], outs[0], strict=True)
                }
            except Exception:  # noqa: BLE001
                sec[f"{gemm}/{mode}"] = {"error": traceback.format_exc()[-1500:]}
            finally:
                linear.scaled_mm = opaque
            print("single linear", gemm, mode, "compiled vs eager rel diff:", sec[f"{gemm}/{mode}"], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/fp8_compile_check.json")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    from primus.torchtitan import compat

    compat.import_torchtitan()
    result: dict = {"command": shlex.join([sys.executable, *sys.argv]), **versions(), "args": vars(args), "cases": {}}
    out = Path(args.out)
    single_linear(result)
    base = build(args)
    gen = torch.Generator(device=DEV).manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=DEV, generator=gen)
    tokens, labels = tokens[:, :-1], tokens[:, 1:]
    cases = {
        "fp32": (None, False, False),
        "bf16": (None, False, True),
        "bf16_compiled": (None, True, True),
        "fp8_primus_eager": ("primus", False, True),
        "fp8_primus_compiled": ("primus", True, True),
        "fp8_torchao_eager": ("torchao", False, True),
        "fp8_torchao_compiled": ("torchao", True, True),
    }
    ref_loss, ref_grads = None, None
    for case, (impl, compiled, autocast) in cases.items():
        try:
            model = copy.deepcopy(base)
            if impl:
                convert(model, impl)
            if compiled:
                compile_blocks(model)
            loss = loss_of(model, tokens, labels, autocast)
            loss.backward()
            g = grads(model)
            row = {"loss": loss.item(), "missing_grads": sorted(n for n, v in g.items() if v is None)}
            if ref_grads is None:
                ref_loss, ref_grads = loss.item(), {n: v.detach().clone() for n, v in g.items()}
            else:
                row["loss_rel_err"] = abs(loss.item() - ref_loss) / ref_loss
                row["grad_rel_err"] = rel_by_group(g, ref_grads)
            if case != "fp32":
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=DEV == "cuda")
                curve = []
                for _ in range(args.steps):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    loss = loss_of(model, tokens, labels, autocast)
                    loss.backward()
                    curve.append(round(loss.item(), 4))
                row["memorise_curve"] = curve
            result["cases"][case] = row
            print(
                case,
                json.dumps({k: v for k, v in row.items() if k != "memorise_curve"}),
                row.get("memorise_curve", [])[-1:],
                flush=True,
            )
        except Exception:  # noqa: BLE001 - torchao missing, or a failure to record
            result["cases"][case] = {"error": traceback.format_exc()[-2000:]}
            print(case, "failed", result["cases"][case]["error"][-600:], flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    result["compiled_fp8_ok"] = gate(result["cases"])
    out.write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(0 if result["compiled_fp8_ok"]["primus"] else 1)


def gate(cases: dict) -> dict[str, bool]:
    """Per FP8 implementation: its compiled case has all gradients, the eager case's error (within 1.5x) and
    a falling loss."""
    out = {}
    for impl in ("primus", "torchao"):
        eager, comp = cases.get(f"fp8_{impl}_eager", {}), cases.get(f"fp8_{impl}_compiled", {})
        if "grad_rel_err" not in comp or "grad_rel_err" not in eager:
            out[impl] = False
            continue
        worse = comp["grad_rel_err"]["block_linears"] / eager["grad_rel_err"]["block_linears"]
        curve = comp["memorise_curve"]
        out[impl] = not comp["missing_grads"] and worse < 1.5 and curve[-1] < curve[0]
        print(f"{impl}: missing grads {comp['missing_grads'][:3]}, block grad error {worse:.2f}x eager's", flush=True)
    return out


if __name__ == "__main__":
    main()
