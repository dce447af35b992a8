"""Primus-TorchTitan against plain TorchTitan on one GPU: the same model, batch and data, side by side.

    python benchmarks/torchtitan_vs_primus.py --out benchmarks/results/torchtitan_overhead.json

Model: the Llama 3.2 1B preset (dim 2048, 16 layers, 32/8 heads, ffn 8192, vocab 128256, llama3 RoPE
scaling) with untied embeddings, because torchtitan 0.2.2's llama3 model has no tying; seq 4096,
micro-batch 2, bf16 autocast, AdamW, eager (``--compile`` compiles the blocks in both). Data: uniform
random tokens in both (plain TorchTitan's text loader needs a downloaded dataset).

- plain TorchTitan: its ``ConfigManager`` parses the command line into a ``JobConfig``; the model is a
  ``bench`` flavor added to ``torchtitan.models.llama3.llama3_args`` (0.2.2 has no registration API), the
  train spec is llama3's with a random-token ``ParallelAwareDataloader``; tokens/s per device is its own
  MetricsProcessor's ``throughput(tps)``.
- Primus: ``primus train llama3.2-1b`` resolved and run in this process (``primus.core.launch.resolve``, ``primus.core.launch.rank``); tokens/s
  per device is what the backend reports to ``metrics.jsonl``.

``--model tiny --seq 64 --steps 12 --warmup 4`` runs the same comparison on a CPU in a few seconds (a check of
this script, not a measurement). The two alternate for ``--rounds`` rounds (the GPU drifts a few % over minutes); each run's tokens/s is the
median over its steps after ``--warmup``; the result is the median over rounds, and the ratio
Primus / plain (target ≥ 0.97).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import overhead_args, release, run_overrides, steady  # noqa: E402

from primus.core.launch.env import free_port  # noqa: E402


def preset_model(preset: str):
    """The preset's ModelConfig (the plain side builds the same shapes from it)."""
    from primus.core.launch.resolve import resolve

    return resolve(preset, [], world_size=1, check_plugins=False).config.model


# --model: the Primus preset, and its model for the plain llama3 flavor ("tiny" is a CPU smoke test of this script)
PRESETS = {"1b": "llama3.2-1b", "3b": "llama3.2-3b", "tiny": "tiny-llama"}
MODELS = {key: (preset, preset_model(preset)) for key, preset in PRESETS.items()}


def one_process_env() -> None:
    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
    ):
        os.environ[key] = value


# ------------------------------------------------------------------------------------------------ plain torchtitan


def register_plain(model) -> None:
    """The preset's shapes (``model``: its ModelConfig) as llama3 flavor "bench" — torchtitan's own
    TransformerModelArgs, filled by primus-torchtitan's shape mapping (the FFN width through llama3's multiple_of /
    multiplier pair; max_seq_len is reset from the job config) — and llama3's train spec with random-token data."""
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.models import llama3
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    from primus.torchtitan.models import llama3_args

    llama3.llama3_args["bench"] = llama3_args(model, 8192)
    vocab = model.vocab_size

    class RandomTokens(IterableDataset):
        def __init__(self, seq_len: int, vocab: int, seed: int) -> None:
            self.seq_len, self.vocab, self.seed = seq_len, vocab, seed

        def __iter__(self):
            gen = torch.Generator().manual_seed(self.seed)
            while True:
                row = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=gen)
                yield {"input": row[:-1]}, row[1:]

    def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **_):
        ds = RandomTokens(job_config.training.seq_len, vocab, seed=dp_rank)
        return ParallelAwareDataloader(
            ds, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=job_config.training.local_batch_size
        )

    spec = dataclasses.replace(
        get_train_spec("llama3"), build_dataloader_fn=build_dataloader, build_tokenizer_fn=None, build_validator_fn=None
    )
    register_train_spec("llama3_random", spec)


class Recorder:
    """A torchtitan metric logger that keeps what its MetricsProcessor logs."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def log(self, metrics: dict, step: int) -> None:
        self.rows.append({"step": step, **metrics})

    def close(self) -> None:
        pass


def run_plain(
    steps: int, seq: int, micro: int, out: Path, compile_: bool, profile: bool = False, global_batch: int | None = None
) -> dict:
    """Plain TorchTitan; ``profile``: torchtitan's own profiler traces the last step (after 3 warm-up steps),
    under ``out/profile_traces``; ``global_batch``: samples per optimizer step (gradient accumulation over
    micro-batches; default one micro-batch)."""
    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer

    argv = [
        "--job.dump_folder",
        str(out),
        "--model.name",
        "llama3_random",
        "--model.flavor",
        "bench",
        "--training.seq_len",
        str(seq),
        "--training.local_batch_size",
        str(micro),
        "--training.steps",
        str(steps),
        "--training.mixed_precision_param",
        "bfloat16",
        "--optimizer.name",
        "AdamW",
        "--optimizer.lr",
        "3e-4",
        "--lr_scheduler.warmup_steps",
        "2",
        "--activation_checkpoint.mode",
        "none",
        "--metrics.log_freq",
        "1",
        "--debug.seed",
        "1234",
    ]
    if global_batch:
        argv += ["--training.global_batch_size", str(global_batch)]
    if compile_:
        argv += ["--compile.enable", "--compile.components", "model,loss"]
    if profile:
        argv += ["--profiling.enable_profiling", "--profiling.profile_freq", str(steps)]
    one_process_env()
    job_config = ConfigManager().parse_args(argv)
    trainer = Trainer(job_config)
    recorder = Recorder()
    trainer.metrics_processor.logger = recorder
    try:
        trainer.train()
    finally:
        trainer.close()
        params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
        del trainer
        release()
    traces = sorted(out.glob("profile_traces/iteration_*/rank0_trace.json"))
    return {
        "trace": str(traces[-1]) if traces else None,
        "tps": [r["throughput(tps)"] for r in recorder.rows],
        "memory_gib": max(r["memory/max_reserved(GiB)"] for r in recorder.rows),
        "loss": [r["loss_metrics/global_avg_loss"] for r in recorder.rows],
        "params": params,
        "argv": argv,
    }


# ------------------------------------------------------------------------------------------------ primus


def run_primus(
    preset: str, steps: int, seq: int, micro: int, out: Path, compile_: bool, extra: tuple[str, ...] = ()
) -> dict:
    """``primus train`` on the torchtitan backend in this process; ``extra``: more overrides (kernels, profile)."""
    from primus.core.launch.rank import run_rank
    from primus.core.launch.resolve import resolve

    overrides = [
        "model.tie_word_embeddings=false",
        *run_overrides(out, seq, micro, steps),
        "train.precision=bf16",
        f"train.compile={str(compile_).lower()}",
        "train.optimizer.lr=3.0e-4",
        "train.optimizer.min_lr=3.0e-5",
        "train.schedule.warmup_steps=2",
        "parallel.recompute=none",
        "backend.name=torchtitan",
        *extra,
    ]
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        os.environ.pop(key, None)
    res = resolve(preset, overrides, world_size=1)
    summary = run_rank(res)
    release()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "tps": [r["tokens_per_s_per_device"] for r in rows],
        "loss": [r["loss"] for r in rows],
        "mfu": [r.get("mfu") for r in rows],
        "memory_gib": max(r["memory_gib"] for r in rows),
        "summary_status": summary.get("status"),
        "kernels": summary.get("kernels"),
        "command": f"primus train {preset} " + shlex.join(overrides),
    }


def main() -> None:
    ap = overhead_args(__doc__, "benchmarks/results/torchtitan_overhead.json", list(MODELS))
    ap.add_argument("--compile", action="store_true", help="torch.compile the blocks in both")
    args = ap.parse_args()

    from primus.torchtitan import compat

    compat.import_torchtitan()
    preset, model = MODELS[args.model]
    register_plain(model)
    rounds: list[dict] = []
    try:
        plain, primus = measure(args, preset, rounds)
    except BaseException:
        # keep what was measured, and why it stopped, for a run on a lent machine that cannot be repeated
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        failed = {"command": shlex.join([sys.executable, *sys.argv]), "rounds": rounds, "error": traceback.format_exc()}
        Path(args.out).write_text(json.dumps(failed, indent=2) + "\n")
        raise
    finish(args, preset, rounds, plain, primus)


def measure(args: argparse.Namespace, preset: str, rounds: list[dict]) -> tuple[dict, dict]:
    """Alternate plain and Primus runs, appending each round's summary; returns the last round's runs."""
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            plain = run_plain(args.steps, args.seq, args.micro_batch, Path(tmp) / f"plain{r}", args.compile)
            primus = run_primus(preset, args.steps, args.seq, args.micro_batch, Path(tmp) / f"primus{r}", args.compile)
            rounds.append(
                {
                    "plain_tokens_per_s": steady(plain["tps"], args.warmup),
                    "primus_tokens_per_s": steady(primus["tps"], args.warmup),
                    "plain_loss_last": plain["loss"][-1],
                    "primus_loss_last": primus["loss"][-1],
                    "primus_mfu": steady([m or 0.0 for m in primus["mfu"]], args.warmup),
                    "plain_peak_memory_gib": plain["memory_gib"],
                    "primus_peak_memory_gib": primus["memory_gib"],
                }
            )
            print(json.dumps(rounds[-1]), flush=True)
    return plain, primus


def finish(args: argparse.Namespace, preset: str, rounds: list[dict], plain: dict, primus: dict) -> None:
    from primus.torchtitan import compat

    plain_tps = statistics.median(r["plain_tokens_per_s"] for r in rounds)
    primus_tps = statistics.median(r["primus_tokens_per_s"] for r in rounds)
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "torchtitan": compat.TORCHTITAN_VERSION,
        "model": f"{preset} preset, untied embeddings (llama3 model), {plain['params']:,} parameters",
        "seq_len": args.seq,
        "micro_batch_size": args.micro_batch,
        "precision": "bf16 autocast",
        "compile": args.compile,
        "steps": args.steps,
        "warmup_steps_excluded": args.warmup,
        "plain_argv": plain["argv"],
        "primus_command": primus["command"],
        "rounds": rounds,
        "plain_tokens_per_s": plain_tps,
        "primus_tokens_per_s": primus_tps,
        "ratio_primus_over_plain": primus_tps / plain_tps,
        "target_ratio": 0.97,
        "meets_target": primus_tps / plain_tps >= 0.97,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("plain_tokens_per_s", "primus_tokens_per_s", "ratio_primus_over_plain", "meets_target")
            }
        )
    )


if __name__ == "__main__":
    main()
