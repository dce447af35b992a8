"""The GPU acceptance suite: every GPU path of both engines in one call, one JSON and one markdown table.

    python3 benchmarks/gpu_suite.py --out DIR                 # on one H100 / H200, ~10.5 minutes: on the lent GPU
                                                              # two calls, --skip startup,edges (502 s on an H100,
                                                              # --budget 540: parts starting later are skipped) and
                                                              # --only startup,edges (135 s)
    python3 benchmarks/gpu_suite.py --out DIR --only moe,fp8_dense
    python3 benchmarks/gpu_suite.py --out DIR --smoke         # the same code on CPU with the tiny presets (nox);
                                                              # where a part's two engine rows differ only by
                                                              # backend.name, one trains, the other is validated

On the lent GPU machine, installing is one line before it (the wheels the image lacks, fetched here by
``benchmarks/gpu/get-wheels.sh``, carried as ``.whl``): ``source benchmarks/gpu/install.sh && python3 benchmarks/gpu_suite.py --out $OUT``.

Parts (``--only`` / ``--skip``), each run as ``primus`` processes or the benchmark scripts beside this one:

- ``dense``: plain TorchTitan (compiled) vs Primus-TorchTitan vs Primus + turbo, plain megatron-core vs
  Primus-Megatron vs + turbo, Llama 3.2 1B at seq 4096 (``turbo_e2e.py``); ratios against each plain engine;
- ``fp8_dense``: Primus + turbo bf16 vs ``kernels.fp8=rowwise`` on each engine, the same tokens: speed and losses;
- ``moe_kernels``: the MoE kernels, forward + backward (``moe_kernels_h200.py``): Triton permute / router vs
  TorchTitan's indexing, the FP8 grouped GEMM vs bf16's at the Qwen3-30B-A3B and Mixtral expert shapes;
- ``moe``: a Qwen3-30B-A3B-shaped model (``--moe-layers`` of its layers) on both engines: turbo's MoE kernels vs
  TorchTitan's, FP8 as ``auto`` decides it and with the experts forced onto FP8, losses against bf16's;
- ``deepseek``: a DeepSeek-V3-architecture model (4 blocks of Moonlight-16B-A3B: latent attention, sigmoid router)
  on both engines, and on megatron with one multi-token-prediction depth (its cost, its ``mtp_loss``);
- ``document_mask``: ``data.document_mask`` (FlexAttention) vs causal attention on the bundled documents;
- ``sft_packing``: fine-tuning chats (synthetic, from the bundled tokenizer) one per sample padded vs packed
  (``data.sft_packing``), TorchTitan: tokens/s of trained tokens and the ratio;
- ``gemm_tuning``: ``primus tune gemm record`` + ``run`` on this GPU, then ``kernels.gemm_tuning`` off vs offline
  with that file;
- ``eval_resume``: evaluation on, SIGTERM mid-run -> exit 75 with a checkpoint -> the same command resumes;
  losses against a straight run;
- ``sft_hf``: fine-tune from a Hugging Face folder (made locally with transformers) -> export -> transformers
  loads it and generates, on both engines;
- ``lora``: ``train.lora`` (rank 16, every projection) against full fine-tuning of Llama 3.2 1B on each engine:
  tokens/s and peak memory;
- ``profile``: ``primus profile`` -> the report page;
- ``startup``: time to the first step, plain engines beside Primus, a fresh process each (``startup.py``), and
  whether a TorchTitan rank still imports what it never uses;
- ``edges``: a run just past the planner's memory band refused before anything is built, and one far past it
  (``train.allow_tight_fit``) running out of memory: one line, exit 3.

Every row: passed / failed with the reason, tokens/s per device, MFU, peak memory against the planner's
prediction (Primus runs), and for pairs the ratio and the loss agreement. A speed feature slower than what it
replaces fails its row. The JSON and the table are rewritten after every part, so a call cut short keeps what ran;
parts that would start after ``--budget`` seconds are recorded as not run (on a GPU; ``--smoke`` runs every part).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import run_overrides, versions  # noqa: E402

GIB = 2**30
TOLERANCE = 0.01  # FP8 losses within 1% of bf16's (mean over the run: fp8_loss_check), as the CPU FP8 tests
ENGINES = ("torchtitan", "megatron")
# --smoke: the engine whose rows a part trains; the other's commands are validated (the same code, another backend)
SMOKE_TRAINS = {"fp8_dense": "torchtitan", "deepseek": "megatron", "sft_hf": "torchtitan", "lora": "megatron"}


# ------------------------------------------------------------------------------------------------ helpers


def primus(*args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "primus.core.cli.app", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def tail(proc: subprocess.CompletedProcess, n: int = 1500) -> str:
    return (proc.stdout + proc.stderr)[-n:]


def predicted_gib(preset: str, overrides: list[str]) -> float | None:
    """The planner's per-GPU memory for this exact one-GPU config, the share the measured peak holds (the runs'
    ``memory_gib`` is ``torch.cuda.max_memory_allocated``: without the CUDA context and the allocator's
    fragmentation, which the planner's total adds); None where it cannot say."""
    try:
        from primus.core.launch.resolve import resolve
        from primus.core.planner.memory import MemoryBreakdown
        from primus.core.planner.strategies import estimate_memory

        return (
            MemoryBreakdown(estimate_memory(resolve(preset, overrides, world_size=1).config, 1).parts).allocated / GIB
        )
    except Exception:  # noqa: BLE001 - a prediction is a column, never the row's failure
        return None


def planner_columns(preset: str, overrides: list[str], peak_gib: float | None) -> dict:
    """``predicted_gib`` (:func:`predicted_gib`) and, with a measured peak, ``memory_error`` (predicted / peak - 1)
    of a run of ``preset`` + ``overrides`` (its output folder left out: the planner does not read it)."""
    pred = predicted_gib(preset, [o for o in overrides if not o.startswith("logging.output_dir")])
    if pred is None:
        return {}
    return {"predicted_gib": pred, **({"memory_error": pred / peak_gib - 1} if peak_gib else {})}


def measured(rows: list[dict], warmup: int) -> dict:
    """tokens/s and MFU (medians after ``warmup`` steps), peak memory and the loss curve of one run's metrics."""
    steady = [r for r in rows if r["step"] > warmup] or rows
    out: dict[str, Any] = {"losses": [r["loss"] for r in rows if "loss" in r]}
    if steady and "tokens_per_s_per_device" in steady[0]:
        out["tokens_per_s"] = statistics.median(r["tokens_per_s_per_device"] for r in steady)
    if steady and steady[0].get("mfu") is not None:
        out["mfu"] = statistics.median(r["mfu"] for r in steady)
    mem = [r["memory_gib"] for r in rows if r.get("memory_gib") is not None]
    if mem:
        out["peak_gib"] = max(mem)
    return out


def loss_agreement(a: list[float], b: list[float], *, mean: bool = False) -> float | None:
    """Largest (``mean``: mean) relative difference between two loss curves (None when they do not line up)."""
    if not a or len(a) != len(b):
        return None
    gaps = [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]
    return sum(gaps) / len(gaps) if mean else max(gaps)


def fp8_loss_check(row: dict, base: dict | None) -> None:
    """An FP8 row's losses against bf16's: the mean relative gap over the run within :data:`TOLERANCE` (the largest
    is recorded too). Not the largest: megatron-core's MoE forward is not deterministic (two bf16 runs from one seed
    differ by 2e-4 at step 1, results/fp8_auto_vs_bf16_losses_h100.json), and without load balancing the routing
    amplifies it; 20 steps of Qwen3-30B-A3B's layers, with nothing in FP8, reached a 1.03% largest gap (0.37% mean)
    in two calls. FP8 numerics that are wrong are off by far more; fp8_training.py's 300-step loss section is the
    convergence check."""
    losses, ref = row.get("losses") or [], (base or {}).get("losses") or []
    row["loss_agreement"] = agree = loss_agreement(losses, ref, mean=True)
    row["loss_gap_max"] = loss_agreement(losses, ref)
    if row["status"] == "passed" and (agree is None or agree > TOLERANCE):
        row["status"], row["reason"] = "failed", f"losses {agree} from bf16's, mean over the run (needs <= {TOLERANCE})"


class Suite:
    """The rows of one call; rewrites ``gpu_suite.json`` / ``gpu_suite.md`` in ``out`` after every part."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out, self.smoke = args, Path(args.out), args.smoke
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work) if args.work else self.out / "runs"
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.lock = threading.Lock()
        self.result = {
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "smoke": self.smoke,
            **versions(),
            "parts": {},
            "rows": self.rows,
        }

    def trains(self, part: str, engine: str) -> bool:
        """Whether this call trains ``part``'s ``engine`` row: always on a GPU; in --smoke one engine a part where
        the other's row is the same code with another backend.name (that row's command is validated instead)."""
        return not self.smoke or SMOKE_TRAINS.get(part, engine) == engine

    # a Primus training run, its metrics and the planner's memory for it
    def train(
        self, name: str, preset: str, overrides: list[str], *, warmup: int, timeout: float = 240, check_only=False
    ) -> dict:
        """``check_only``: the command is validated (``primus config validate``), not run (--smoke)."""
        out = self.work / name
        ov = [*overrides, f"logging.output_dir={out}"]
        t0, started = time.monotonic(), time.time()
        row: dict[str, Any] = {"row": name, "command": shlex.join(["primus", "train", preset, *ov])}
        if check_only:
            proc = primus("config", "validate", preset, *ov, timeout=60)
            if proc.returncode == 0:
                return {**row, "status": "passed", "smoke": True, "note": "validated, not trained (smoke)"}
        else:
            proc = primus("train", preset, *ov, timeout=timeout)
        row["wall_s"] = round(time.monotonic() - t0, 1)
        if proc.returncode != 0:
            return {**row, "status": "failed", "reason": f"exit {proc.returncode}: {tail(proc)}"}
        rows = metrics(out)
        try:  # where a run's wall time goes: start-up (its process's start to the first step's end; core's record)
            row["first_step_s"] = json.loads((out / "summary.json").read_text())["startup"]["to_first_step_s"]
        except (OSError, KeyError, ValueError):
            if rows and "time" in rows[0]:
                row["first_step_s"] = round(rows[0]["time"] - started, 1)
        row |= {"status": "passed", **measured(rows, warmup)}
        if not self.smoke:
            row |= planner_columns(preset, overrides, row.get("peak_gib"))
        return row

    def add(self, part: str, rows: list[dict], seconds: float | None = None) -> None:
        with self.lock:  # parts that run side by side add their rows from threads
            if seconds is not None:
                self.result["parts"][part] = round(seconds, 1)
            self.rows.extend({"part": part, **r} for r in rows)
            # in the parts' order, whichever side-by-side part ended first (rows and part times alike)
            self.rows.sort(key=lambda r: list(PARTS).index(r["part"]))
            times = self.result["parts"]
            self.result["parts"] = {p: times[p] for p in PARTS if p in times}
            self.save()

    def save(self) -> None:
        self.result["wall_s"] = round(time.monotonic() - self.t0, 1)
        (self.out / "gpu_suite.json").write_text(json.dumps(self.result, indent=1) + "\n")
        (self.out / "gpu_suite.md").write_text(table(self.result))

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def speed_pair(row: dict, base: dict | None, least: float, what: str) -> dict:
    """``row`` against ``base``: the tokens/s ratio; on a GPU a ratio under ``least`` fails the row (a speed
    feature slower than what it replaces)."""
    if base is None or "tokens_per_s" not in row or "tokens_per_s" not in base:
        return row
    row["ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
    row["vs"] = base["row"]
    if row["status"] == "passed" and not row.get("smoke") and row["ratio"] < least:
        row["status"], row["reason"] = "failed", f"{what}: {row['ratio']:.2f}x {base['row']} (needs >= {least})"
    return row


# ------------------------------------------------------------------------------------------------ parts


def part_dense(s: Suite) -> list[dict]:
    out = s.work / "dense.json"
    cmd = [sys.executable, str(HERE / "turbo_e2e.py"), "--out", str(out)]
    if s.smoke:  # the plain and turbo cases: the same code as the others, half the CPU time
        cmd += ["--smoke", "--cases", "tt_plain,tt_turbo,mg_plain,mg_turbo"]
    else:
        cmd += ["--models", "1b-4096", "--steps", str(s.args.steps), "--warmup", "4", "--rounds", "1"]
        cmd += ["--cases", "tt_plain,tt_core,tt_turbo,mg_plain,mg_core,mg_turbo"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    if not out.exists():
        return [{"row": "dense", "status": "failed", "reason": f"turbo_e2e exit {proc.returncode}: {tail(proc)}"}]
    result = json.loads(out.read_text())
    rows = []
    for model, m in result["models"].items():
        cases = m["cases"]
        for case, c in cases.items():
            row = {"row": f"dense/{model}/{case}", "micro_batch": c.get("micro_batch"), "smoke": s.smoke}
            if "error" in c:
                rows.append({**row, "status": "failed", "reason": c["error"][-1500:]})
                continue
            row |= {"status": "passed", "tokens_per_s": c["tokens_per_s"], "mfu": c["mfu"]}
            row |= {"peak_gib": c.get("peak_memory_gib"), "command": c.get("command")}
            rows.append(row)
        by = {r["row"].rsplit("/", 1)[1]: r for r in rows if r["row"].startswith(f"dense/{model}/")}
        for case, r in by.items():
            engine = case.split("_")[0]
            if case.endswith(("turbo", "turbo_lean")):
                speed_pair(r, by.get(f"{engine}_plain"), 1.0, "turbo slower than the plain engine")
            elif case.endswith("core"):
                speed_pair(r, by.get(f"{engine}_plain"), 0.95, "Primus' overhead over the plain engine")
    return rows


# The same bf16 run in two calls on one H100 measured 51,642 and 52,437 tokens/s (fp8_dense/torchtitan/bf16,
# 1.5% apart); pairs within one call 0.998x and 1.003x (dense/tt_core, gemm_tuning/offline). A speed feature that
# changes nothing on a run (FP8 whose rule keeps every linear bf16) must not fail on that noise.
NOISE = 0.02


def part_fp8_dense(s: Suite) -> list[dict]:
    # Llama 8B's shapes (4 of its blocks, to fit one GPU with room) as a user leaves train.compile (off) and core's
    # rule (fp8_recipe.linears: auto, eager: the linears of at least 4096 x 4096); on the smoke's tiny model every
    # linear (linears: all), so that FP8 really runs. Compiled TorchTitan FP8 measured 0.99x on an H100 (2026-12-06
    # results) and its two compiles took 60 s of the suite's budget: it is left to fp8_training.py.
    preset = "tiny-llama" if s.smoke else "llama3.1-8b"
    seq, micro, steps = (64, 2, 3) if s.smoke else (4096, 2, s.args.steps)
    rows = []
    for engine in ENGINES:
        common = [*run_overrides("", seq, micro, steps)[:-1], f"backend.name={engine}", "train.precision=bf16"]
        common += ["kernels.fp8_recipe.linears=all"] if s.smoke else ["model.num_layers=4"]
        check = not s.trains("fp8_dense", engine)
        bf16 = s.train(f"fp8_dense/{engine}/bf16", preset, common, warmup=4, check_only=check)
        fp8 = s.train(
            f"fp8_dense/{engine}/fp8_rowwise", preset, [*common, "kernels.fp8=rowwise"], warmup=4, check_only=check
        )
        fp8["smoke"] = s.smoke
        if not check:
            speed_pair(fp8, bf16, 1.0 - NOISE, "FP8 slower than bf16")
            fp8_loss_check(fp8, bf16)
        rows += [bf16, fp8]
    return rows


def part_moe_kernels(s: Suite) -> list[dict]:
    out = s.work / "moe_kernels.json"
    cmd = [sys.executable, str(HERE / "moe_kernels_h200.py"), "--out", str(out), *(["--smoke"] if s.smoke else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if not out.exists():
        return [{"row": "moe_kernels", "status": "failed", "reason": f"exit {proc.returncode}: {tail(proc)}"}]
    rows = []
    for r in json.loads(out.read_text())["shapes"]:
        name = f"moe_kernels/{r['op']}/{r['shape']}"
        if r["op"] == "grouped_gemm":
            ratio = r["speedup_fp8"]
            row = {"row": name, "status": "passed", "ratio": ratio, "vs": "bf16 grouped_mm", "kernel": r["fp8_kernel"]}
            row |= {"ms": r["fp8_ms"], "base_ms": r["bf16_ms"], "rel_err_fp8_y": r["rel_err_fp8_y"]}
            # the goal of the FP8 experts; where it is missed, `kernels.fp8_recipe.experts: auto` keeps them bf16
            row["note"] = "goal 1.2x met" if ratio >= 1.2 else "below the 1.2x goal: auto keeps the experts bf16"
        else:
            row = {"row": name, "status": "passed", "ratio": r["speedup"], "vs": "torch (TorchTitan's indexing)"}
            row |= {"ms": r["triton_ms"], "base_ms": r["torch_ms"]}
            if not s.smoke and r["speedup"] < 1.0:  # auto picks these kernels: slower fails
                row["status"], row["reason"] = "failed", f"Triton {r['op']} {r['speedup']:.2f}x torch's"
        rows.append(row)
    return rows


# FP8 as a user sets it (kernels.fp8=rowwise; the experts as core's rule decides); the forced-FP8-experts cases of
# moe_h200.py are measured by hand (their GEMM is in moe_kernels)
MOE_CASES = "tt_turbo,tt_turbo_ref_moe,tt_turbo_fp8,mg_turbo,mg_turbo_fp8"


def part_moe(s: Suite) -> list[dict]:
    out = s.work / "moe.json"
    cmd = [sys.executable, str(HERE / "moe_h200.py"), "--out", str(out)]
    if s.smoke:  # one bf16 and one FP8 case an engine: the same code as the others
        cmd += ["--smoke", "--cases", "tt_turbo,tt_turbo_fp8,mg_turbo,mg_turbo_fp8"]
    else:
        cmd += ["--cases", MOE_CASES, "--layers", str(s.args.moe_layers), "--steps", "20", "--warmup", "6"]
        cmd += ["--case-timeout", "150"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if not out.exists():
        return [{"row": "moe", "status": "failed", "reason": f"exit {proc.returncode}: {tail(proc)}"}]
    result = json.loads(out.read_text())
    rows, by = [], {}
    for c in result["cases"]:
        row = {"row": f"moe/{c['case']}", "command": c.get("command"), "smoke": s.smoke}
        if "error" in c:
            rows.append({**row, "status": "failed", "reason": c["error"][-1500:]})
            continue
        row |= {"status": "passed", "tokens_per_s": c["tokens_per_s_per_device"], "mfu": c.get("mfu")}
        row |= {"peak_gib": c["peak_memory_gib"], "losses": c.get("losses"), "experts": experts_note(c)}
        if not s.smoke and c.get("command"):
            row |= planner_columns(*train_argv(c["command"]), row["peak_gib"])
        by[c["case"]] = row
        rows.append(row)
    for case, r in by.items():
        engine = case.split("_")[0]
        if case == "tt_turbo":
            speed_pair(r, by.get("tt_turbo_ref_moe"), 1.0, "turbo's MoE kernels slower than TorchTitan's")
        if "fp8" in case:
            base = by.get(f"{engine}_turbo")
            fp8_loss_check(r, base)
            # `auto` must never be slower; forcing FP8 experts is measured, and may be
            speed_pair(r, base, 1.0 - NOISE if not case.endswith("experts") else 0.0, "FP8 (auto) slower than bf16")
    return rows


def part_deepseek(s: Suite) -> list[dict]:
    """A DeepSeek-V3-architecture model (Moonlight-16B-A3B's shapes: multi-head latent attention, sigmoid router with
    the loss-free bias, 64 routed + 2 shared experts, the first block dense; 4 of its 27 blocks) on each engine with
    primus-turbo: tokens/s, MFU and peak memory against the planner's."""
    preset = "tiny-deepseek" if s.smoke else "moonlight-16b-a3b"
    seq, micro, steps = (64, 2, 2) if s.smoke else (4096, 1, 12)
    common = [*run_overrides("", seq, micro, steps)[:-1], "train.precision=bf16"]
    common += [] if s.smoke else ["model.num_layers=4"]
    rows = [
        s.train(
            f"deepseek/{e}", preset, [*common, f"backend.name={e}"], warmup=4, check_only=not s.trains("deepseek", e)
        )
        for e in ENGINES
    ]
    # one multi-token-prediction depth (megatron only): its cost against the same model without, and its loss logged
    mtp = s.train("deepseek/megatron_mtp", preset, [*common, "backend.name=megatron", "model.mtp.layers=1"], warmup=4)
    if mtp["status"] == "passed":
        mtp_losses = [r["mtp_loss"] for r in metrics(s.work / mtp["row"]) if "mtp_loss" in r]
        if mtp_losses:
            mtp["mtp_losses"] = mtp_losses
        else:
            mtp |= {"status": "failed", "reason": "no mtp_loss in the run's metrics"}
    return [*rows, speed_pair(mtp, rows[-1], 0.0, "MTP")]


def train_argv(command: str) -> tuple[str, list[str]]:
    """(preset, overrides) of a ``... train PRESET OVERRIDES...`` command line, whatever runs the CLI."""
    argv = shlex.split(command)
    i = argv.index("train")
    return argv[i + 1], argv[i + 2 :]


def experts_note(case: dict) -> str | None:
    applied = case.get("kernels_applied") or {}
    return applied.get("experts") or (case.get("kernels") or {}).get("fp8")


def part_document_mask(s: Suite) -> list[dict]:
    # the whole model: the block mask is built once a step (the documents change with the batch), a cost that 4 of
    # the 16 blocks do not amortise (4 blocks measured 0.92x, 16 blocks 1.04x on an H100)
    preset = "tiny-llama" if s.smoke else "llama3.2-1b"
    seq, micro, steps = (64, 2, 3) if s.smoke else (4096, 2, 10)
    data = ["data.source=bundled", "data.tokenizer=bundled", "model.vocab_size=2048", "backend.name=torchtitan"]
    common = [*run_overrides("", seq, micro, steps)[:-1], *data]
    causal = s.train("document_mask/causal", preset, common, warmup=3)
    masked = s.train("document_mask/masked", preset, [*common, "data.document_mask=true"], warmup=3)
    masked["ratio"] = (masked.get("tokens_per_s") or 0) / causal["tokens_per_s"] if "tokens_per_s" in causal else None
    masked["vs"] = "document_mask/causal"
    if masked["status"] == "passed" and masked.get("losses") == causal.get("losses"):
        masked["status"], masked["reason"] = "failed", "masked losses equal causal ones: the mask did nothing"
    return [causal, masked]


WORDS = "the a of to and in is it you that he was for on are with as his they be at one have this from".split()


def synthetic_chats(n: int, median_words: float, seed: int = 0) -> list[dict]:
    """``n`` chats of one to three turns, offline and seeded: each chat's words drawn log-normal around
    ``median_words`` (sigma 1: a long tail, as real fine-tuning sets have, some chats longer than the sample), split
    over its messages, words from a short list."""
    import numpy as np

    rng = np.random.default_rng(seed)
    chats = []
    for _ in range(n):
        turns = int(rng.integers(1, 4))
        total = rng.lognormal(np.log(median_words), 1.0)
        words = (rng.dirichlet(np.ones(2 * turns)) * total).astype(int) + 1
        messages = [
            {"role": ("user", "assistant")[k % 2], "content": " ".join(rng.choice(WORDS, size=w))}
            for k, w in enumerate(words)
        ]
        chats.append({"messages": messages})
    return chats


def trained_per_step(preset: str, overrides: list[str], steps: int) -> tuple[list[int], int]:
    """The trained (answer) tokens of each step's global batch of a one-GPU run (the samples core hands the engine,
    in its order), and the positions of a global batch."""
    from primus.core.data import GlobalOrder
    from primus.core.data.sft import IGNORE_INDEX
    from primus.core.data.splits import training_samples
    from primus.core.launch.resolve import resolve

    cfg = resolve(preset, overrides, world_size=1).config
    samples = training_samples(cfg)
    order, g = GlobalOrder(len(samples), cfg.train.seed), int(cfg.train.global_batch_size)
    per_step = [
        sum(int((samples[order[k]][1] != IGNORE_INDEX).sum()) for k in range(i * g, (i + 1) * g)) for i in range(steps)
    ]
    return per_step, g * cfg.train.seq_len


def part_sft_packing(s: Suite) -> list[dict]:
    """Fine-tuning chats one per sample padded to the sequence (``data.sft_packing: padded``) vs packed whole into
    it with attention kept inside each chat (``packed``, FlexAttention's document mask on the GPU), on TorchTitan:
    tokens/s of trained (answer) tokens, each step's count from the samples that step read; the ratio is what
    packing buys over padding every chat to the sequence."""
    preset = "tiny-llama" if s.smoke else "llama3.2-1b"
    seq, micro, steps, words = (128, 2, 3, 16) if s.smoke else (4096, 2, 10, 500)
    root = s.work / "sft_packing"
    root.mkdir(parents=True, exist_ok=True)
    from primus.core.data.tokenizer import load_tokenizer

    load_tokenizer("bundled").save(str(root / "tokenizer.json"))  # the bundled tokenizer, with a chat template
    template = {"chat_template": SFT_TEMPLATE, "eos_token": "<|endoftext|>"}
    (root / "tokenizer_config.json").write_text(json.dumps(template))
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in synthetic_chats(200 if s.smoke else 1000, words)))
    common = [*run_overrides("", seq, micro, steps)[:-1], "train.objective=sft", f"data.source={data}"]
    common += [f"data.tokenizer={root}", "model.vocab_size=2048", "backend.name=torchtitan"]
    common += [] if s.smoke else ["train.precision=bf16"]
    rows = []
    for layout in ("padded", "packed"):
        overrides = [*common, f"data.sft_packing={layout}"]
        # --smoke trains the packed row (the new path), validates the padded one: its engine path is tests' own
        check = s.smoke and layout == "padded"
        row = s.train(f"sft_packing/{layout}", preset, overrides, warmup=3, check_only=check)
        row["smoke"] = s.smoke
        if row["status"] == "passed" and not check:
            trained, positions = trained_per_step(preset, overrides, steps)
            done = [r for r in metrics(s.work / row["row"]) if "interval_s" in r]
            steady = [r for r in done if r["step"] > 3] or done
            row["positions_per_s"] = row.pop("tokens_per_s", None)
            row["tokens_per_s"] = statistics.median(trained[r["step"] - 1] / r["interval_s"] for r in steady)
            row["trained_share"] = sum(trained) / (steps * positions)
            row["note"] = f"tokens/s of trained tokens; {row['trained_share']:.0%} of the positions trained"
        rows.append(row)
    return [rows[0], speed_pair(rows[1], rows[0], 1.0, "packed slower than padded")]


def tuned_here(s: Suite, preset: str, overrides: list[str]) -> tuple[Path | None, dict]:
    """A user's offline flow on this machine: ``primus tune gemm record`` then ``run``; the results file (None when a
    step failed) and what the row says about it (seconds, shapes searched and retuned, or the failure)."""
    out = s.work / "gemm_tuning" / "tune"
    out.mkdir(parents=True, exist_ok=True)
    shapes, results = out / "shapes.json", out / "results.json"
    t0 = time.monotonic()
    proc = primus("tune", "gemm", "record", preset, *overrides, "--out", str(shapes), timeout=120)
    if proc.returncode == 0:  # a small search: the suite's budget, not the best algorithms there are
        search = ["--budget", "8", "--iterations", "20", "--repeats", "20", "--out", str(results)]
        proc = primus("tune", "gemm", "run", str(shapes), *search, timeout=180)
    if proc.returncode != 0:
        return None, {"reason": f"tuning failed: exit {proc.returncode}: {tail(proc)}"}
    entries = json.loads(results.read_text())["entries"]
    retuned = sum(e["winner"] == "tuned" for e in entries)
    note = f"tuned here in {time.monotonic() - t0:.0f} s: {retuned} of {len(entries)} GEMM shapes retuned"
    return results, {"note": note, "tuning_file": str(results)}


def part_gemm_tuning(s: Suite) -> list[dict]:
    # Tuned on this GPU first (a file made on another device warns and its algorithms may be slower here: the H200
    # file measured 0.98x on an H100, 2026-12-07), then the same run off and offline.
    preset = "tiny-llama" if s.smoke else "llama3.2-1b"
    seq, micro, steps = (64, 2, 3) if s.smoke else (4096, 2, 10)
    common = [*run_overrides("", seq, micro, steps)[:-1], "backend.name=torchtitan", "train.compile=false"]
    common += ["train.precision=bf16", *([] if s.smoke else ["model.num_layers=4"])]  # the same GEMM shapes
    off = s.train("gemm_tuning/off", preset, [*common, "kernels.gemm_tuning=off"], warmup=4)
    tuning, about = tuned_here(s, preset, common)
    refused = "GEMM tuning needs a GPU"  # on CPU, `primus tune gemm run` and the run refuse, as documented
    if tuning is None and not (s.smoke and refused in about["reason"]):
        return [off, {"row": "gemm_tuning/offline", "status": "failed", **about}]
    offline = [*common, "kernels.gemm_tuning=offline", f"kernels.gemm_tuning_file={tuning or 'none.json'}"]
    tuned = s.train("gemm_tuning/offline", preset, offline, warmup=4) | (about if tuning else {})
    if s.smoke and refused in tuned.get("reason", ""):
        tuned = {**{k: v for k, v in tuned.items() if k != "reason"}, "status": "passed"}
        tuned["note"] = "recorded; tuning and the run refused on CPU, as documented"
    tuned["smoke"] = s.smoke
    speed_pair(tuned, off, 0.98, "tuned GEMMs slower than untuned")
    return [off, tuned]


def _small_model(s: Suite) -> tuple[str, list[str]]:
    """A model whose checkpoints write in seconds: tiny-llama on CPU, two layers of Llama 3.2 1B at vocab 2048 on
    the GPU, on the bundled documents."""
    data = ["data.source=bundled", "data.tokenizer=bundled", "model.vocab_size=2048"]
    if s.smoke:
        return "tiny-llama", ["train.seq_len=64", *data]
    return "llama3.2-1b", ["model.num_layers=2", "train.seq_len=2048", "train.micro_batch_size=4", *data]


RESUME_END = 12  # steps of the resumed run and of the straight one; the kill comes after step 3


def _sigterm_after(cmd: list[str], out: Path, step: int) -> tuple[subprocess.Popen, str]:
    """Start ``cmd`` and SIGTERM it once its metrics reach ``step``: the process and its output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and not any(r["step"] >= step for r in metrics(out)):
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc, proc.communicate(timeout=240)[0]


def part_eval_resume(s: Suite) -> list[dict]:
    """What a preempted job does: a long run with evaluation and checkpoints gets SIGTERM after a few steps (exit
    75, one checkpoint), the requeued command resumes to :data:`RESUME_END` steps; a straight run of that length
    (constant learning rate, so the runs' schedules agree), run beside the killed one, gives the reference losses."""
    preset, model = _small_model(s)
    common = [*model, "train.schedule.warmup_steps=0", "train.schedule.decay=constant", "logging.interval=1"]
    common += ["eval.holdout=0.05", "eval.interval=2", "eval.batches=2", "checkpoint.interval=50"]
    common += ["checkpoint.resume=auto", "logging.tensorboard=false", "logging.progress=false"]
    row: dict[str, Any] = {"row": "eval_resume/sigterm_resume", "status": "passed"}
    out = s.work / "eval_resume" / "killed"
    cmd = [sys.executable, "-m", "primus.core.cli.app", "train", preset, *common, "train.steps=400"]
    cmd += [f"logging.output_dir={out}"]
    row["command"] = shlex.join(["primus", *cmd[3:]])
    end = RESUME_END
    with ThreadPoolExecutor(max_workers=1) as pool:
        straight_run = pool.submit(s.train, "eval_resume/straight", preset, [*common, f"train.steps={end}"], warmup=2)
        proc, log = _sigterm_after(cmd, out, step=3)
        straight = straight_run.result()
    stopped = max((r["step"] for r in metrics(out)), default=0)
    if proc.returncode != 75 or not 3 <= stopped < end - 1:
        reason = f"exit {proc.returncode} at step {stopped} (75 before step {end - 1} expected): {log[-1200:]}"
        return [straight, {**row, "status": "failed", "reason": reason}]
    resumed = primus("train", preset, *common, f"train.steps={end}", f"logging.output_dir={out}", timeout=240)
    if resumed.returncode != 0:
        return [straight, {**row, "status": "failed", "reason": f"resume exit {resumed.returncode}: {tail(resumed)}"}]
    after = {r["step"]: r for r in metrics(out)}
    ref = {r["step"]: r for r in metrics(s.work / "eval_resume" / "straight")}
    row |= {"stopped_at": stopped, "steps": sorted(after)}
    row["loss_agreement"] = loss_agreement(
        [after[k]["loss"] for k in sorted(after)], [ref[k]["loss"] for k in sorted(ref)]
    )
    row["eval_loss"] = [after[k]["eval_loss"] for k in sorted(after) if "eval_loss" in after[k]]
    if sorted(after) != list(range(1, end + 1)):
        row["status"], row["reason"] = "failed", f"metrics.jsonl steps {sorted(after)}: each step once expected"
    elif row["loss_agreement"] is None or row["loss_agreement"] > 1e-3:
        row["status"], row["reason"] = "failed", f"resumed losses {row['loss_agreement']} from the straight run's"
    elif not row["eval_loss"]:
        row["status"], row["reason"] = "failed", "no evaluation in the metrics"
    return [straight, row]


SFT_TEMPLATE = (  # ChatML-like, as tests/test_sft.py: the assistant header is context, the answer trained on
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def part_sft_hf(s: Suite) -> list[dict]:
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from hf_helpers import make_hf

    from primus.core.data.tokenizer import load_tokenizer

    root = s.work / "sft_hf"
    hf = make_hf(root / "hf", "llama", seed=3)
    load_tokenizer("bundled").save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": SFT_TEMPLATE, "eos_token": "<|endoftext|>"}))
    records = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{2 * i}"},
            ]
        }
        for i in range(32)
    ] + [{"prompt": f"Spell {i}:", "completion": f" the number {i} is {i}"} for i in range(32)]
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    common = [f"train.init_from={hf}", f"data.source={data}", "train.steps=4", "train.seq_len=48"]
    common += ["train.micro_batch_size=2", "train.global_batch_size=4", "train.schedule.warmup_steps=0"]
    common += ["logging.interval=1", "logging.tensorboard=false", "logging.progress=false"]

    def one(engine: str) -> dict:
        check = not s.trains("sft_hf", engine)
        row = s.train(f"sft_hf/{engine}", "sft", [*common, f"backend.name={engine}"], warmup=1, check_only=check)
        if row["status"] == "passed" and not check:
            exported = root / f"export_{engine}"
            proc = primus(
                "checkpoint",
                "export",
                str(s.work / "sft_hf" / engine / "checkpoints"),
                "--to-hf",
                str(exported),
                timeout=180,
            )
            if proc.returncode != 0:
                row |= {"status": "failed", "reason": f"export exit {proc.returncode}: {tail(proc)}"}
            else:
                device = "cuda" if torch.cuda.is_available() else "cpu"
                model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).to(device)
                prompt = torch.tensor([[5, 6, 7, 8]], device=device)
                generated = model.generate(prompt, max_new_tokens=8, do_sample=False)
                row["generated"] = generated.tolist()
                if generated.shape != (1, 12):
                    row |= {"status": "failed", "reason": f"transformers generated {tuple(generated.shape)}"}
        return row

    with ThreadPoolExecutor(max_workers=2) as pool:  # the engines side by side (small runs: seconds of GPU each)
        return list(pool.map(one, ENGINES))


def part_lora(s: Suite) -> list[dict]:
    # LoRA (train.lora, rank 16 on every projection) against full fine-tuning of the same model on one GPU, each
    # engine: tokens/s (LoRA skips the base weights' gradients: ~1/3 of the linears' backward) and peak memory (no
    # gradients or optimizer state for the frozen bf16 base). Llama 3.2 1B at seq 4096, canonical init on random
    # tokens: the speed of a fine-tuning step does not depend on the weights or the data.
    preset = "tiny-llama" if s.smoke else "llama3.2-1b"
    seq, micro, steps = (64, 2, 3) if s.smoke else (4096, 2, s.args.steps)
    rows = []
    for engine in ENGINES:
        common = [*run_overrides("", seq, micro, steps)[:-1], f"backend.name={engine}", "train.precision=bf16"]
        check = not s.trains("lora", engine)
        full = s.train(f"lora/{engine}/full", preset, common, warmup=4, check_only=check)
        lora = s.train(f"lora/{engine}/lora", preset, [*common, "train.lora.rank=16"], warmup=4, check_only=check)
        lora["smoke"] = s.smoke  # on CPU the code runs; its speed is no measurement
        if not check:
            speed_pair(lora, full, 1.0 - NOISE, "LoRA slower than full fine-tuning")
            if lora.get("peak_gib") and full.get("peak_gib"):
                lora["memory_ratio"] = lora["peak_gib"] / full["peak_gib"]
                if lora["status"] == "passed" and not s.smoke and lora["memory_ratio"] >= 1.0:
                    lora["status"], lora["reason"] = (
                        "failed",
                        f"LoRA's peak {lora['peak_gib']:.1f} GiB not below full's",
                    )
        rows += [full, lora]
    return rows


def part_profile(s: Suite) -> list[dict]:
    preset, model = _small_model(s)
    out = s.work / "profile"
    ov = [
        *model,
        "train.steps=6",
        "profile.wait=1",
        "profile.warmup=1",
        "profile.active=2",
        f"logging.output_dir={out}",
    ]
    t0 = time.monotonic()
    proc = primus("profile", preset, *ov, timeout=240)
    row = {"row": "profile", "command": shlex.join(["primus", "profile", preset, *ov]), "wall_s": time.monotonic() - t0}
    pages = sorted(out.rglob("report.md")) + sorted(out.rglob("report.html"))
    if proc.returncode != 0 or len(pages) < 2:
        return [{**row, "status": "failed", "reason": f"exit {proc.returncode}, pages {pages}: {tail(proc)}"}]
    md = pages[0].read_text()
    return [{**row, "status": "passed", "report": str(pages[0]), "report_head": md[:600]}]


def part_startup(s: Suite) -> list[dict]:
    """Time to the first step, plain engines beside Primus, each a fresh process (``startup.py``)."""
    out = s.work / "startup"
    cmd = [sys.executable, str(HERE / "startup.py"), "--out", str(out)]
    if s.smoke:  # one plain and one Primus case: the two code paths, half the CPU time
        cmd += ["--smoke", "--cases", "tt_plain,mg_primus"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480)
    if not (out / "startup.json").exists():
        return [{"row": "startup", "status": "failed", "reason": f"startup.py exit {proc.returncode}: {tail(proc)}"}]
    result = json.loads((out / "startup.json").read_text())
    rows = []
    for case, c in result["cases"].items():
        row = {"row": f"startup/{case}", "smoke": s.smoke, "command": c.get("command")}
        if "error" in c:
            rows.append({**row, "status": "failed", "reason": c["error"][-1500:]})
            continue
        parts = ", ".join(f"{k} {c[k]}" for k in ("to_build_s", "build_s", "first_step_s"))
        rows.append({**row, "status": "passed", "first_step_s": c["to_first_step_s"], "startup": c, "note": parts})
    unused = result.get("unused_imports_s") or {}
    row = {"row": "startup/torchtitan_unused_imports", "unused_imports_s": unused}
    if unused:  # what a TorchTitan rank imports and never uses, with the seconds it costs
        rows.append({**row, "status": "failed", "reason": f"a TorchTitan rank imports {unused}"})
    else:
        rows.append({**row, "status": "passed", "note": "a TorchTitan rank imports none of datasets, pandas, pyarrow"})
    return rows


# the run that did not fit on an H100 (the issue): Llama 3.2 3B on megatron at seq 4096, its micro-batch found here
FIT_CASE = ("llama3.2-3b", ["backend.name=megatron", "train.seq_len=4096", "data.source=mock", "train.steps=3"])


def _past_the_band(factor: float) -> int | None:
    """The smallest micro-batch of :data:`FIT_CASE` whose estimate on this GPU exceeds its usable memory's band
    × ``factor`` (1: just past the band, refused; more: certain to run out of memory)."""
    from primus.core.launch.resolve import resolve
    from primus.core.planner import calibration as cal
    from primus.core.planner.auto import local_device
    from primus.core.planner.memory import GIB
    from primus.core.planner.search import USABLE
    from primus.core.planner.strategies import estimate_memory

    dev = local_device()
    limit = dev.memory_gib * USABLE * (1 + cal.FIT_TOLERANCE) * factor
    for mbs in range(1, 65):
        cfg = resolve(FIT_CASE[0], [*FIT_CASE[1], f"train.micro_batch_size={mbs}"], world_size=1).config
        if estimate_memory(cfg, 1).total / GIB > limit:
            return mbs
    return None


def _one_error_line(proc: subprocess.CompletedProcess) -> str | None:
    """The one ``error:`` line of a failed run, None where there are several or a traceback."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    clean = not any(sign in proc.stderr for sign in ("Traceback", "[rank0]:", "ChildFailedError"))
    return lines[0] if len(lines) == 1 and clean else None


def part_edges(s: Suite) -> list[dict]:
    """What a user meets at the edges of memory: a run sized just past the planner's band is refused before anything
    is built (exit 2, one line with the planner's pick, no run folder); one far past it, run anyway with
    ``train.allow_tight_fit``, runs out of memory and ends in one line (exit 3, ``primus.core.run.oom``). On CPU
    (--smoke) the refusal's command is validated (no device memory to hold) and the out-of-memory error is injected."""
    rows = []
    preset, words = FIT_CASE
    if s.smoke:
        preset, words = "tiny-demo-megatron", ["train.steps=3", "checkpoint.interval=1"]
    refused = s.work / "edges_refused"
    mbs = None if s.smoke else _past_the_band(1.0)
    cmd = ["train", preset, *words, f"train.micro_batch_size={mbs or 2}", f"logging.output_dir={refused}"]
    row: dict[str, Any] = {"row": "edges/fit_refused", "command": shlex.join(["primus", *cmd])}
    if s.smoke:
        proc = primus("config", "validate", *cmd[1:], timeout=60)
        ok = proc.returncode == 0
        rows.append({**row, "status": "passed" if ok else "failed", "smoke": True, "note": "validated (CPU)"})
    else:
        t0 = time.monotonic()
        proc = primus(*cmd, timeout=120)
        line, took = _one_error_line(proc), round(time.monotonic() - t0, 1)
        ok = proc.returncode == 2 and line and "does not fit" in line and "the planner's pick" in line
        ok = ok and not refused.exists()
        row |= {"wall_s": took, "micro_batch": mbs, "line": line}
        rows.append({**row, "status": "passed" if ok else "failed", "note" if ok else "reason": line or tail(proc)})
    oom = s.work / "edges_oom"
    if s.smoke:
        extra = ["backend.extra.fault_injection.oom_at_step=2"]
        mbs = 2
    else:
        mbs = _past_the_band(1.2)
        extra = ["train.allow_tight_fit=true"]
    cmd = ["train", preset, *words, f"train.micro_batch_size={mbs}", *extra, f"logging.output_dir={oom}"]
    proc = primus(*cmd, timeout=240)
    line = _one_error_line(proc)
    ok = proc.returncode == 3 and line is not None and line.startswith("error: out of memory ")
    row = {"row": "edges/oom_line", "command": shlex.join(["primus", *cmd]), "micro_batch": mbs, "line": line}
    rows.append({**row, "status": "passed" if ok else "failed", "note" if ok else "reason": line or tail(proc)})
    return rows


PARTS: dict[str, Callable[[Suite], list[dict]]] = {
    "dense": part_dense,
    "fp8_dense": part_fp8_dense,
    "moe_kernels": part_moe_kernels,
    "moe": part_moe,
    "deepseek": part_deepseek,
    "document_mask": part_document_mask,
    "sft_packing": part_sft_packing,
    "gemm_tuning": part_gemm_tuning,
    "eval_resume": part_eval_resume,
    "sft_hf": part_sft_hf,
    "lora": part_lora,
    "profile": part_profile,
    "startup": part_startup,
    "edges": part_edges,
}


# ------------------------------------------------------------------------------------------------ the table


def _fmt(v: Any, spec: str) -> str:
    return "" if v is None else format(v, spec)


def table(result: dict) -> str:
    """The markdown table of a suite result (also what the README's speed tables are rendered from)."""
    head = f"GPU suite: {result.get('gpu')}, torch {result.get('torch')}, {result['date']}"
    lines = [f"# {head}{' (smoke)' if result['smoke'] else ''}", "", f"`{result['command']}`", ""]
    lines += [f"wall time {result.get('wall_s')} s", ""]
    lines += [
        "| row | status | tokens/s | MFU | ratio | vs | peak GiB | planner GiB | loss agreement | to first step s "
        "| reason / note |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        reason = (r.get("reason") or r.get("note") or r.get("experts") or "").replace("\n", " ").replace("|", "/")
        lines.append(
            f"| {r['row']} | {r['status']} | {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('mfu'), '.1%')} "
            f"| {_fmt(r.get('ratio'), '.2f')} | {r.get('vs') or ''} | {_fmt(r.get('peak_gib'), '.1f')} "
            f"| {_fmt(r.get('predicted_gib'), '.1f')} | {_fmt(r.get('loss_agreement'), '.1e')} "
            f"| {_fmt(r.get('first_step_s'), '.1f')} | {reason[:300]} |"
        )
    counts = {k: sum(r["status"] == k for r in result["rows"]) for k in ("passed", "failed", "not run")}
    lines += ["", f"{counts['passed']} passed, {counts['failed']} failed, {counts['not run']} not run", ""]
    return "\n".join(lines)


# parts that measure no speed: run at once, beside each other, after the speed parts (each one's own folders)
BESIDE = ("eval_resume", "sft_hf", "profile")


def run_part(suite: Suite, part: str) -> None:
    if not suite.smoke and suite.elapsed() > suite.args.budget:  # a smoke run is a test: every part runs
        reason = f"suite past its {suite.args.budget:.0f} s budget"
        suite.add(part, [{"row": part, "status": "not run", "reason": reason}])
        return
    t0 = time.monotonic()
    print(f"--- {part} ({suite.elapsed():.0f} s)", flush=True)
    try:
        rows = PARTS[part](suite)
    except Exception as exc:  # noqa: BLE001 - a broken part is a failed row, the others still run
        rows = [{"row": part, "status": "failed", "reason": f"{type(exc).__name__}: {str(exc)[-1500:]}"}]
    suite.add(part, rows, time.monotonic() - t0)
    for r in rows:
        print(f"{r['row']}: {r['status']} {(r.get('reason') or '')[:300]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_suite.json, gpu_suite.md and the runs")
    ap.add_argument("--only", default="", help=f"comma list of parts: {','.join(PARTS)}")
    ap.add_argument("--skip", default="", help="comma list of parts to leave out")
    ap.add_argument("--work", help="folder for the runs' outputs (default OUT/runs)")
    ap.add_argument("--smoke", action="store_true", help="tiny presets on CPU: runs the suite's code, no speed goals")
    ap.add_argument("--budget", type=float, default=540, help="seconds: later parts are recorded as not run")
    ap.add_argument("--steps", type=int, default=12, help="steps of the dense and FP8 speed runs")
    ap.add_argument("--moe-layers", type=int, default=4, help="layers of Qwen3-30B-A3B in the moe part")
    args = ap.parse_args()
    only = [p for p in args.only.split(",") if p] or list(PARTS)
    skip = {p for p in args.skip.split(",") if p}
    if bad := [p for p in [*only, *skip] if p not in PARTS]:
        ap.error(f"unknown part(s) {bad}: the parts are {', '.join(PARTS)}")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    suite = Suite(args)
    chosen = [p for p in only if p not in skip]
    # the speed parts one after another (alone on the GPU); then the correctness parts side by side
    for part in [p for p in chosen if p not in BESIDE]:
        run_part(suite, part)
    with ThreadPoolExecutor(max_workers=len(BESIDE)) as pool:
        list(pool.map(lambda p: run_part(suite, p), [p for p in chosen if p in BESIDE]))
    print(table(suite.result))
    return 1 if any(r["status"] == "failed" for r in suite.rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
