"""GEMM tuning on one GPU: the recorded GEMM shapes of model presets, default vs tuned TF/s per shape, and a model
step with and without the tuned dispatch.

    python benchmarks/gemm_tuning.py --out benchmarks/results/gemm_tuning.json

Per preset (default: Llama 3.2 1B and 3B; seq 4096 × micro-batch 2 = 8192 tokens, bf16):

1. record: one forward + backward of the preset's decoder (primus.tune.model) on the GPU under the recorder;
   every GEMM with layout (forward x·Wᵀ NT, input gradient NN, weight gradient TN), dtype and count.
2. search: cuBLASLt through nvmath (``--limit`` heuristic candidates, ``--iterations`` autotune), then default
   (torch) vs the autotuned algorithm measured interleaved, ``--repeats`` rounds, medians. The winner needs
   ``--min-gain``.
3. validate: a second, independent interleaved measurement of every searched shape, the tuned side running
   through the dispatch path a training run uses (the algorithm decoded from the results file, planned once,
   reused with new operands); ``--validate-rounds`` rounds, medians. This is the number to trust: the search
   picks winners, so its own measurement is biased upwards.
4. step (``--step-rounds`` > 0): fwd+bwd of the decoder with its linears dispatching through the tuned plans
   vs plain torch, alternating blocks of ``--step-iters`` steps, median tokens/s.

Run-to-run noise on the H200 is up to ~7%: every comparison is interleaved and reported as a median.
Each stage is caught and logged separately; the JSON is rewritten after every stage. A results file per preset
(``<out dir>/<preset>-gemm.json``) can be used by a run with ``kernels.gemm_tuning=offline``.
``--cpu-check`` runs stage 1 on CPU with tiny-llama (a check of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

try:
    import primus.tune  # noqa: F401
except ImportError:  # running from a checkout without primus-tune installed
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root / "packages" / "primus-tune" / "src"), str(root / "packages" / "primus-core" / "src")]

import torch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def record(preset: str, seq: int, micro_batch: int, device: str):
    from primus.core.launch.resolve import resolve
    from primus.tune.model import step_gemms

    cfg = resolve(preset, [f"train.seq_len={seq}", f"train.micro_batch_size={micro_batch}"], check_plugins=False).config
    rec = step_gemms(cfg.model, micro_batch=micro_batch, seq_len=seq, dtype=torch.bfloat16, device=device)
    meta = step_gemms(cfg.model, micro_batch=micro_batch, seq_len=seq, dtype=torch.bfloat16, device="meta")
    same = [r.to_dict() for r in rec.records] == [r.to_dict() for r in meta.records]
    return cfg, rec.records, same


def validate(entries, repeats: int, rounds: int) -> list[dict]:
    """Default vs the tuned algorithm through NvmathPlans (the training dispatch path), interleaved."""
    from primus.tune.bench import interleaved_medians, operands, tflops
    from primus.tune.dispatch import NvmathPlans

    rows = []
    for e in entries:
        if not isinstance(e.solution, dict) or "algorithm" not in e.solution:
            continue
        row = {"shape": e.shape.key, "searched_winner": e.winner}
        try:
            plans = NvmathPlans({e.shape.key: e})
            a, b = operands(e.shape, "cuda")
            fn = plans.lookup(e.shape)
            ref = torch.mm(a, b)
            got = fn(a, b)
            row["max_rel_err"] = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            row["out_strides_match"] = got.stride() == ref.stride()
            d, t = [], []
            for _ in range(rounds):
                ms = interleaved_medians(
                    {"default": lambda a=a, b=b: torch.mm(a, b), "tuned": lambda a=a, b=b, fn=fn: fn(a, b)},
                    device="cuda",
                    repeats=repeats,
                )
                d.append(tflops(e.shape, ms["default"]))
                t.append(tflops(e.shape, ms["tuned"]))
            row["default_tflops"], row["tuned_tflops"] = statistics.median(d), statistics.median(t)
            row["default_rounds"], row["tuned_rounds"] = d, t
            row["gain"] = row["tuned_tflops"] / row["default_tflops"] - 1
            plans.free()
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            log(f"validate {e.shape.key}: {row['error']}")
        rows.append(row)
        log(f"  {e.shape.key}: validated {row.get('gain', float('nan')) * 100:+.1f}%")
    return rows


class Switch:
    """A plan provider that can be turned off: one model, both variants, same weights."""

    def __init__(self, plans):
        self.plans, self.on = plans, True

    def lookup(self, shape):
        return self.plans.lookup(shape) if self.on else None


def step_benchmark(cfg, results, seq: int, micro_batch: int, rounds: int, iters: int) -> dict:
    import torch.nn.functional as F

    from primus.tune.dispatch import NvmathPlans, patch_linears
    from primus.tune.model import Decoder

    torch.manual_seed(0)
    model = Decoder(cfg.model).to(device="cuda", dtype=torch.bfloat16)
    plans = NvmathPlans(results.tuned())
    switch = Switch(plans)
    patch_linears(model, switch)
    tokens = torch.randint(0, cfg.model.vocab_size, (micro_batch, seq), device="cuda")

    def step():
        logits = model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
        model.zero_grad(set_to_none=True)

    def timed(on: bool) -> float:
        switch.on = on
        step()  # a step at the start of a block is not timed (plans made, allocator settled)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
        return iters * micro_batch * seq / (time.perf_counter() - t0)

    default, tuned = [], []
    for r in range(rounds):
        for on in (r % 2 == 0, r % 2 == 1):
            (tuned if on else default).append(timed(on))
    out = {
        "default_tokens_per_s": statistics.median(default),
        "tuned_tokens_per_s": statistics.median(tuned),
        "default_rounds": default,
        "tuned_rounds": tuned,
        "tuned_gemm_calls": sum(plans.hits.values()),
    }
    out["gain"] = out["tuned_tokens_per_s"] / out["default_tokens_per_s"] - 1
    plans.free()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["llama3.2-1b", "llama3.2-3b"])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--limit", type=int, default=16, help="cuBLASLt heuristic candidates per shape")
    p.add_argument("--iterations", type=int, default=20, help="nvmath autotune iterations")
    p.add_argument("--repeats", type=int, default=30, help="interleaved rounds per measurement")
    p.add_argument("--min-gain", type=float, default=0.01)
    p.add_argument("--validate-rounds", type=int, default=3)
    p.add_argument("--step-rounds", type=int, default=6)
    p.add_argument("--step-iters", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cpu-check", action="store_true", help="record tiny-llama on CPU only (script check)")
    args = p.parse_args()

    from primus.tune.results import GemmResults, current_environment
    from primus.tune.searchers import CublasLtSearcher, SearchBudget

    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = current_environment()
    report: dict = {"environment": env.__dict__, "args": {k: str(v) for k, v in vars(args).items()}, "presets": {}}

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")

    if args.cpu_check:
        cfg, records, same = record("tiny-llama", 32, 2, "cpu")
        report["presets"]["tiny-llama"] = {"shapes": [r.to_dict() for r in records], "cpu_equals_meta": same}
        save()
        log(f"cpu check: {len(records)} shapes, cpu == meta: {same} -> {args.out}")
        return

    budget = SearchBudget(limit=args.limit, iterations=args.iterations, repeats=args.repeats, min_gain=args.min_gain)
    for preset in args.presets:
        item: dict = {"errors": []}
        report["presets"][preset] = item
        try:
            t0 = time.perf_counter()
            cfg, records, same = record(preset, args.seq, args.micro_batch, "cuda")
            item["shapes"] = [r.to_dict() for r in records]
            item["gpu_record_equals_meta"] = same
            item["tokens"] = args.seq * args.micro_batch
            log(f"{preset}: {len(records)} GEMM shapes recorded in {time.perf_counter() - t0:.1f}s (== meta: {same})")
            torch.cuda.empty_cache()
        except Exception:
            item["errors"].append({"stage": "record", "error": traceback.format_exc()})
            log(f"{preset}: record failed\n{traceback.format_exc()}")
            save()
            continue
        save()
        results = GemmResults(env, searcher="cublaslt", extra={"preset": preset, "seq": args.seq})
        try:
            t0 = time.perf_counter()
            searcher = CublasLtSearcher()
            for r in records:
                (entry,) = searcher.tune([r.shape], budget)
                results.add(entry)
                g = entry.gain
                log(
                    f"  {r.shape.key} x{r.count}: default {entry.default_tflops:.0f} tuned "
                    f"{entry.tuned_tflops or 0:.0f} TF/s ({'-' if g is None else f'{g * 100:+.1f}%'}) -> {entry.winner}"
                    + (f" [{entry.note}]" if entry.note else "")
                )
            item["search_s"] = time.perf_counter() - t0
            item["search"] = [e.to_dict() for e in results.entries.values()]
            results.save(args.out.parent / f"{preset}-gemm.json")
        except Exception:
            item["errors"].append({"stage": "search", "error": traceback.format_exc()})
            log(f"{preset}: search failed\n{traceback.format_exc()}")
        save()
        try:
            item["validation"] = validate(list(results.entries.values()), args.repeats, args.validate_rounds)
            won = [v for v in item["validation"] if v.get("searched_winner") == "tuned" and "gain" in v]
            if won:
                item["validated_median_gain_of_retuned"] = statistics.median(v["gain"] for v in won)
            item["validated_worst_gain_of_retuned"] = min((v["gain"] for v in won), default=None)
        except Exception:
            item["errors"].append({"stage": "validate", "error": traceback.format_exc()})
            log(f"{preset}: validate failed\n{traceback.format_exc()}")
        save()
        if args.step_rounds > 0:
            try:
                item["step"] = step_benchmark(
                    cfg, results, args.seq, args.micro_batch, args.step_rounds, args.step_iters
                )
                log(f"{preset}: model step tokens/s {item['step']}")
            except Exception:
                item["errors"].append({"stage": "step", "error": traceback.format_exc()})
                log(f"{preset}: step failed\n{traceback.format_exc()}")
            save()
        torch.cuda.empty_cache()
    log(f"-> {args.out}")


if __name__ == "__main__":
    main()
