"""FP8 training on one GPU: primus-turbo's FP8 linear (tensorwise, rowwise) vs bf16, through ``primus train``'s
torchtitan backend, plus a GPU correctness check of the FP8 linear itself. One process, one JSON.

    python3 benchmarks/fp8_training.py --out benchmarks/results/fp8_training.json
    python3 benchmarks/fp8_training.py --out /tmp/fp8_smoke.json --smoke      # < 60 s: 2-layer 1B, few steps

Sections of the JSON (each written as soon as it is measured; a failing case records its error):

- ``linear``: per GEMM shape of Llama 3.2 3B (8192 tokens), for each recipe, the FP8 linear's relative
  error vs an fp32 reference (forward, dgrad, wgrad) next to bf16's own error, the Triton quantizer vs the
  PyTorch one (bytes equal, scales equal), and fwd+bwd time vs bf16 ``F.linear`` (do_bench medians).
- ``throughput``: Llama 3.2 1B and 3B presets at seq 4096, micro-batch 2, random tokens, eager
  (``--compile`` compiles the blocks; ``--extra`` adds overrides to every case, e.g. kernel pins), cases
  (``--cases``) bf16 / fp8 tensorwise / fp8 rowwise, each with primus-turbo's FP8 linear or torchao's
  (``*_torchao``, where torchao is installed), interleaved over
  ``--rounds``; median tokens/s of the steps after ``--warmup``, MFU at the bf16 peak (989 TFLOP/s), peak
  memory; the speedup of each FP8 case over bf16 (goal: ≥ 1.3× on 3B).
- ``loss``: a 4-layer Llama 3.2 1B (``--loss-model 3b --loss-layers 0``: the 3B preset at its full depth; vocab
  2048, the bundled tokenizer) on the bundled text corpus (``data.source=bundled``: stdlib docstrings),
  ``--loss-steps`` (300) steps per case from the same seed, LR warmup ``--loss-warmup`` (30) steps; measure:
  mean |Δloss| / loss_bf16 over the last 100 steps, per FP8 case and for ``bf16_seed2`` (bf16 from another seed,
  the measure's floor). Sessions 3-5's loss results ran a 2-step warmup, which spikes every run's loss early.

Expected full-run GPU time: ~4-5 min (linear ~20 s; throughput 6 runs of 14 steps incl. model build;
loss 3 × 300 steps of a 4-layer model at 4k tokens/step).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import PEAK_BF16, rel, steady, versions  # noqa: E402
from torchtitan_vs_primus import run_primus  # noqa: E402

# rowwise with e4m3 gradients (torchao's rowwise recipe): whether cuBLAS/CUTLASS take an e5m2 first operand
# with rowwise scales is what the ``linear`` section's rowwise_e5m2 entries record
PRIMUS, TORCHAO = "kernels.fp8_recipe.implementation=primus", "kernels.fp8_recipe.implementation=torchao"
CASES = {
    "bf16": (),
    "fp8_tensorwise": ("kernels.fp8=tensorwise", PRIMUS),
    # the backward GEMMs accumulate in the tensor cores' reduced precision too (faster, less exact)
    "fp8_tensorwise_fastacc": ("kernels.fp8=tensorwise", PRIMUS, "kernels.fp8_recipe.fast_accum_backward=true"),
    "fp8_rowwise": ("kernels.fp8=rowwise", "kernels.fp8_recipe.grad_dtype=e4m3", PRIMUS),
    "fp8_tensorwise_torchao": ("kernels.fp8=tensorwise", TORCHAO),
    "fp8_rowwise_torchao": ("kernels.fp8=rowwise", "kernels.fp8_recipe.grad_dtype=e4m3", TORCHAO),
    # the output head (the vocab GEMMs, ~12% of the 3B model's FLOPs) in FP8 too; its loss then runs on the logits
    "fp8_tensorwise_torchao_head": ("kernels.fp8=tensorwise", TORCHAO, "kernels.fp8_recipe.bf16_output_head=false"),
    # bf16 from another seed (init and data order): how far two bf16 runs drift apart, the floor of the loss measure
    "bf16_seed2": ("train.seed=2",),
}
FP8_CASES = [c for c in CASES if not c.startswith("bf16")]
PRESETS = {"1b": "llama3.2-1b", "3b": "llama3.2-3b"}
# Llama 3.2 3B linears at 8192 tokens: (tokens, in, out)
SHAPES_3B = {
    "qkv": (8192, 3072, 5120),
    "o": (8192, 3072, 3072),
    "gate_up": (8192, 3072, 16384),
    "down": (8192, 8192, 3072),
}
LOSS_MODEL = ("model.vocab_size=2048", "data.source=bundled", "data.tokenizer=bundled")


def save(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def linear_case(name: str, shape: tuple[int, int, int], recipe_kw: dict, smoke: bool) -> dict:
    import triton.testing

    from primus.turbo.fp8.linear import Fp8State, fp8_linear
    from primus.turbo.fp8.quantize import quantize
    from primus.turbo.fp8.recipe import Fp8Recipe

    m, k, n = (s // 8 for s in shape) if smoke else shape
    recipe = Fp8Recipe(**recipe_kw)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16().requires_grad_()
    dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yr = xr @ wr.t()
    yr.backward(dy.float())
    state = Fp8State(recipe.amax_history)
    y = fp8_linear(x, w, recipe=recipe, state=state)
    y.backward(dy)
    xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yb = torch.nn.functional.linear(xb, wb)
    yb.backward(dy)
    out = {
        "shape_m_k_n": [m, k, n],
        "recipe": recipe_kw,
        "fp8_rel_err": {"out": rel(y, yr), "dgrad": rel(x.grad, xr.grad), "wgrad": rel(w.grad, wr.grad)},
        "bf16_rel_err": {"out": rel(yb, yr), "dgrad": rel(xb.grad, xr.grad), "wgrad": rel(wb.grad, wr.grad)},
    }
    rowwise = recipe.mode == "rowwise"
    qt, qp = (
        quantize(x.detach(), "e4m3", rowwise=rowwise, impl="triton"),
        quantize(x.detach(), "e4m3", rowwise=rowwise, impl="torch"),
    )
    out["triton_vs_torch_quantize"] = {
        "bytes_equal_fraction": (qt.data.view(torch.uint8) == qp.data.view(torch.uint8)).float().mean().item(),
        "scale_max_rel_diff": ((qt.scale_inv - qp.scale_inv).abs() / qp.scale_inv).max().item(),
    }

    def fp8_step():
        fp8_linear(x, w, recipe=recipe, state=state).backward(dy)

    def bf16_step():
        torch.nn.functional.linear(xb, wb).backward(dy)

    rep = 20 if smoke else 100
    t8 = triton.testing.do_bench(fp8_step, rep=rep, return_mode="median")
    tb = triton.testing.do_bench(bf16_step, rep=rep, return_mode="median")
    flops = 6 * m * k * n
    out["fwd_bwd_ms"] = {"fp8": t8, "bf16": tb, "speedup": tb / t8}
    out["fwd_bwd_tflops"] = {"fp8": flops / t8 / 1e9, "bf16": flops / tb / 1e9}
    tq = triton.testing.do_bench(lambda: quantize(x.detach(), "e4m3", rowwise=rowwise, impl="triton"), rep=rep)
    tp = triton.testing.do_bench(lambda: quantize(x.detach(), "e4m3", rowwise=rowwise, impl="torch"), rep=rep)
    out["quantize_x_ms"] = {"triton": tq, "torch": tp}
    print(f"linear {name} {recipe_kw}: err {out['fp8_rel_err']} fwd+bwd {tb:.3f} -> {t8:.3f} ms", flush=True)
    return out


def train_case(preset: str, case: str, *, steps: int, seq: int, micro: int, compile_: bool, extra=()) -> dict:
    """One ``primus train`` run of ``case`` (torchtitan backend)."""
    import tempfile

    out = Path(tempfile.mkdtemp(prefix=f"fp8-{case}-"))
    t0 = time.time()
    r = run_primus(preset, steps, seq, micro, out, compile_, extra=(*CASES[case], *extra))
    r["wall_s"] = time.time() - t0
    return r


def throughput(args: argparse.Namespace, result: dict, out: Path) -> None:
    models = ["1b"] if args.smoke else args.models
    steps, warmup = (4, 2) if args.smoke else (args.steps, args.warmup)
    extra = (*(("model.num_layers=2",) if args.smoke else ()), *args.extra)
    seq = 1024 if args.smoke else args.seq
    sec = result.setdefault("throughput", {})
    for model in models:
        runs: dict[str, list[dict]] = {c: [] for c in args.cases}
        for rnd in range(1 if args.smoke else args.rounds):
            for case in args.cases:  # interleaved: bf16, tensorwise, rowwise, then again
                try:
                    r = train_case(
                        PRESETS[model],
                        case,
                        steps=steps,
                        seq=seq,
                        micro=args.micro_batch,
                        compile_=args.compile,
                        extra=extra,
                    )
                    r["tps_steady"] = steady(r["tps"], warmup, last=steps - 1 if steps > warmup + 1 else steps)
                    runs[case].append(r)
                    print(
                        f"{model} round {rnd} {case}: {r['tps_steady']:.0f} tok/s, {r['memory_gib']:.1f} GiB",
                        flush=True,
                    )
                except Exception:
                    runs[case].append({"error": traceback.format_exc()})
                    print(f"{model} {case} failed:\n{runs[case][-1]['error']}", flush=True)
                sec[model] = summarize(runs, model, seq)
                save(out, result)


def summarize(runs: dict[str, list[dict]], model: str, seq: int) -> dict:
    from primus.core.launch.resolve import resolve
    from primus.core.planner.modelmath import flops_per_token

    cfg = resolve(PRESETS[model], ["model.tie_word_embeddings=false", f"train.seq_len={seq}"], world_size=1).config
    fpt = flops_per_token(cfg.model, seq)
    out: dict = {"flops_per_token": fpt, "cases": {}}
    for case, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        entry = {"runs": rs}
        if ok:
            tps = statistics.median(r["tps_steady"] for r in ok)
            entry.update(
                tokens_per_s=tps,
                mfu_at_bf16_peak=tps * fpt / PEAK_BF16,
                peak_memory_gib=max(r["memory_gib"] for r in ok),
            )
        out["cases"][case] = entry
    base = out["cases"].get("bf16", {}).get("tokens_per_s")
    for case in FP8_CASES:
        tps = out["cases"].get(case, {}).get("tokens_per_s")
        if base and tps:
            out["cases"][case]["speedup_vs_bf16"] = tps / base
    if model == "3b" and base:
        best = max((c.get("speedup_vs_bf16", 0) for c in out["cases"].values()), default=0)
        out["goal_1_3x_met"] = best >= 1.3
    return out


def loss_curves(args: argparse.Namespace, result: dict, out: Path) -> None:
    steps = 20 if args.smoke else args.loss_steps
    window = min(100, steps // 2)
    depth = (f"model.num_layers={args.loss_layers}",) if args.loss_layers else ()
    lr = (f"train.optimizer.lr={args.loss_lr}", f"train.optimizer.min_lr={args.loss_lr / 10}")
    extra = (*depth, *LOSS_MODEL, *lr, f"train.schedule.warmup_steps={args.loss_warmup}")
    preset = PRESETS[args.loss_model]
    sec = result.setdefault(
        "loss", {"steps": steps, "window": window, "model": " ".join((preset, *depth, *LOSS_MODEL))}
    )
    curves = {}
    for case in args.cases:
        try:
            r = train_case(
                preset,
                case,
                steps=steps,
                seq=args.loss_seq,
                micro=args.loss_micro_batch,
                compile_=args.loss_compile,
                extra=extra,
            )
            curves[case] = r["loss"]
            sec[case] = {"loss": r["loss"], "wall_s": r["wall_s"], "command": r["command"], "kernels": r["kernels"]}
            print(f"loss {case}: {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f} in {r['wall_s']:.0f} s", flush=True)
        except Exception:
            sec[case] = {"error": traceback.format_exc()}
            print(f"loss {case} failed:\n{sec[case]['error']}", flush=True)
        save(out, result)
    ref = curves.get("bf16")
    for case in [*FP8_CASES, "bf16_seed2"]:
        if ref and case in curves:
            tail = list(zip(curves[case][-window:], ref[-window:], strict=True))
            sec[case]["mean_abs_rel_dloss_last_window"] = statistics.mean(abs(a - b) / b for a, b in tail)
            sec[case]["final_loss_rel_diff"] = (curves[case][-1] - ref[-1]) / ref[-1]
            sec[case]["loss_fell"] = statistics.mean(curves[case][-10:]) < statistics.mean(curves[case][:10])
    save(out, result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/fp8_training.json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--models", nargs="+", choices=sorted(PRESETS), default=["1b", "3b"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="torch.compile the blocks (all cases)")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=["bf16", "fp8_tensorwise", "fp8_rowwise"])
    ap.add_argument("--extra", nargs="*", default=[], help="more primus overrides for every throughput case")
    ap.add_argument("--loss-steps", type=int, default=300)
    ap.add_argument("--loss-seq", type=int, default=1024)
    ap.add_argument("--loss-micro-batch", type=int, default=4)
    ap.add_argument("--loss-model", choices=sorted(PRESETS), default="1b")
    ap.add_argument("--loss-layers", type=int, default=4, help="the loss model's depth (0: the preset's)")
    ap.add_argument("--loss-lr", type=float, default=1.0e-3)
    ap.add_argument("--loss-warmup", type=int, default=30, help="LR warmup steps of the loss runs")
    ap.add_argument("--loss-compile", action="store_true", help="compile the blocks in the loss section too")
    ap.add_argument("--sections", nargs="+", default=["linear", "throughput", "loss"])
    args = ap.parse_args()
    out = Path(args.out)
    result: dict = {"command": shlex.join([sys.executable, *sys.argv]), "versions": versions(), "args": vars(args)}
    save(out, result)
    if not torch.cuda.is_available():
        result["error"] = "no CUDA device: this benchmark measures the H200"
        save(out, result)
        raise SystemExit(result["error"])
    from primus.torchtitan import compat

    compat.import_torchtitan()
    t0 = time.time()
    if "linear" in args.sections:
        sec = result.setdefault("linear", {})
        recipes = {
            "tensorwise_e5m2": {"mode": "tensorwise"},
            "tensorwise_delayed": {"mode": "tensorwise", "scaling": "delayed"},
            "rowwise_e5m2": {"mode": "rowwise"},
            "rowwise_e4m3": {"mode": "rowwise", "grad_dtype": "e4m3"},
        }
        for name, shape in SHAPES_3B.items():
            for rname, kw in recipes.items():
                try:
                    sec[f"{name}/{rname}"] = linear_case(name, shape, kw, args.smoke)
                except Exception:
                    sec[f"{name}/{rname}"] = {"error": traceback.format_exc()}
                    print(f"linear {name} {rname} failed:\n{sec[f'{name}/{rname}']['error']}", flush=True)
                save(out, result)
            if args.smoke:
                break
    if "throughput" in args.sections:
        throughput(args, result, out)
    if "loss" in args.sections:
        loss_curves(args, result, out)
    result["wall_s"] = time.time() - t0
    save(out, result)
    print(f"done in {result['wall_s']:.0f} s -> {out}", flush=True)


if __name__ == "__main__":
    main()
