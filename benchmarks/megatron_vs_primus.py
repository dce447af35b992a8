"""Primus-Megatron against plain megatron-core on one GPU: the same model, batch and data, side by side.

    python benchmarks/megatron_vs_primus.py --out benchmarks/results/megatron_overhead.json

Model: the Llama 3.2 1B preset (dim 2048, 16 layers, 32/8 heads, head dim 64, ffn 8192, vocab 128256,
tied embeddings, RoPE theta 500000 with llama3 scaling factor 32); seq 4096, micro-batch 2, bf16
(Float16Module, fp32 main params), Adam(W) through megatron's optimizer, grad clip 1.0, uniform
random tokens in both.

- plain megatron-core: ``GPTModel`` with ``get_gpt_layer_local_spec(normalization="RMSNorm")`` whose
  core attention is replaced by a small SDPA module (the local ``DotProductAttention`` materialises
  [b, h, s, s] scores and runs out of memory at seq 4096), megatron ``DistributedDataParallel``,
  ``get_megatron_optimizer``, ``get_forward_backward_func``; its own loop, timed per step with a sync.
- Primus: ``primus train llama3.2-1b backend.name=megatron ...`` resolved and run in-process
  (``primus.core.launch.resolve``, ``primus.core.launch.rank``), kernels as selected: ``--kernels auto`` takes primus-turbo's where it is
  installed, ``--kernels core`` pins core's SDPA attention and plain PyTorch norm / SwiGLU (the "no turbo"
  comparison); tokens/s per device as the backend reports it to ``metrics.jsonl``.

Each run is a fresh subprocess (megatron keeps global parallel state); the two alternate for
``--rounds`` rounds, since the GPU drifts a few % over minutes. A run's tokens/s is the median over
its steps after ``--warmup`` (Primus: of its metrics lines, one per ``--log-interval`` steps, each
timing those steps and the logging); the result is the median over rounds and the ratio Primus / plain
(target ≥ 1.0). ``--model tiny --seq 64 --steps 8 --warmup 2`` runs the comparison on a CPU in seconds
(a check of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import LastStepsProfiler, overhead_args, plain_gpt_parts, steady  # noqa: E402

from primus.core.launch.env import free_port  # noqa: E402

# plain megatron-core's argument -> the preset's ModelConfig field it takes
PLAIN_FROM_PRESET = {"num_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
                     "num_query_groups": "num_kv_heads", "kv_channels": "kv_channels", "ffn_hidden_size": "ffn_hidden_size",
                     "vocab": "vocab_size", "tied": "tie_word_embeddings", "theta": "rope_theta", "eps": "norm_eps"}  # fmt: skip


def plain_shape(preset: str) -> dict:
    """The preset's model as the plain megatron-core side builds it (read from the preset, so both sides agree)."""
    from primus.core.launch.resolve import resolve

    m = resolve(preset, [], world_size=1, check_plugins=False).config.model
    shape = {arg: getattr(m, field) for arg, field in PLAIN_FROM_PRESET.items()}
    return {**shape, "rope_scaling_factor": m.rope_scaling.factor if m.rope_scaling else None}


# --model: the Primus preset, and its shape for plain megatron-core ("tiny" checks this script on a CPU)
MODELS = {
    key: (preset, plain_shape(preset))
    for key, preset in {"1b": "llama3.2-1b", "3b": "llama3.2-3b", "tiny": "tiny-llama"}.items()
}
LR, MIN_LR, WD, CLIP = 3e-4, 3e-5, 0.1, 1.0


# ------------------------------------------------------------------------------------------------ plain


def run_plain(args: argparse.Namespace) -> dict:
    """megatron-core's public API only, the way its own examples train a GPTModel."""
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    if not gpu:  # the CPU smoke test borrows Primus's CUDA-to-CPU redirection (megatron assumes CUDA)
        from primus.megatron.cpu import redirect_to_cpu

        redirect_to_cpu()
    dist.init_process_group(
        "nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    shape = MODELS[args.model][1]
    bf16 = gpu
    dtype = torch.bfloat16 if bf16 else torch.float32
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    config, spec = plain_gpt_parts(
        gpu,
        bf16,
        num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_query_groups"],
        kv_channels=shape["kv_channels"],
        ffn_hidden_size=shape["ffn_hidden_size"],
        layernorm_epsilon=shape["eps"],
    )
    scaling = shape["rope_scaling_factor"]
    model = GPTModel(
        config,
        spec,
        vocab_size=shape["vocab"],
        max_sequence_length=args.seq,
        share_embeddings_and_output_weights=shape["tied"],
        position_embedding_type="rope",
        rotary_base=shape["theta"],
        rope_scaling=scaling is not None,
        rope_scaling_factor=scaling or 8.0,
    ).to(torch.cuda.current_device())
    params = sum(p.numel() for p in model.parameters())
    if bf16:
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            min_lr=MIN_LR,
            weight_decay=WD,
            adam_beta1=0.9,
            adam_beta2=0.95,
            clip_grad=CLIP,
            bf16=bf16,
            params_dtype=dtype,
        ),
        [ddp],
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    fb = get_forward_backward_func()
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, shape["vocab"], (args.steps, args.micro_batch, args.seq + 1), generator=gen)

    def forward_step(it, m):
        batch = next(it).to(torch.cuda.current_device(), non_blocking=True)
        out = m(batch[:, :-1], None, None, labels=batch[:, 1:])
        return out, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})

    sync = torch.cuda.synchronize if gpu else (lambda: None)
    trace = Path(args.workdir) / "plain_trace.json" if getattr(args, "profile", False) else None
    prof = LastStepsProfiler(trace, args.steps)
    tps, losses = [], []
    for step in range(args.steps):
        sync()
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for g in opt.param_groups:  # constant LR: the schedule is not what is measured
            g["lr"] = LR
        out = fb(
            forward_step_func=forward_step,
            data_iterator=iter([data[step]]),
            model=[ddp],
            num_microbatches=1,
            seq_length=args.seq,
            micro_batch_size=args.micro_batch,
            forward_only=False,
        )
        opt.step()
        loss = out[0]["lm loss"].item()
        sync()
        tps.append(args.micro_batch * args.seq / (time.perf_counter() - t0))
        losses.append(loss)
        prof.step()
    prof.close()
    mem = torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return {"tps": tps, "loss": losses, "params": params, "memory_gib": mem, "trace": str(trace) if trace else None}


# ------------------------------------------------------------------------------------------------ primus


# --kernels core: core's plain-PyTorch providers even where primus-turbo is installed (the "no turbo")
CORE_KERNELS = [
    f"kernels.{op}={name}"
    for op, name in (
        ("attention", "sdpa"),
        ("rms_norm", "torch"),
        ("swiglu", "torch"),
        ("cross_entropy", "torch"),
        ("rope", "torch"),
        ("grouped_gemm", "torch"),
        ("moe_permute", "torch"),
        ("moe_router", "torch"),
    )
]


def primus_overrides(args: argparse.Namespace, out: Path) -> list[str]:
    return [
        "backend.name=megatron",
        f"train.seq_len={args.seq}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch}",
        f"train.steps={args.steps}",
        f"train.precision={'bf16' if args.gpu else 'fp32'}",
        f"train.optimizer.lr={LR}",
        f"train.optimizer.min_lr={MIN_LR}",
        f"train.optimizer.weight_decay={WD}",
        f"train.grad_clip={CLIP}",
        "train.schedule.warmup_steps=1",
        "data.source=mock",
        "checkpoint.enabled=false",
        f"logging.interval={args.log_interval}",
        "logging.tensorboard=false",
        "logging.progress=false",
        f"logging.output_dir={out}",
        *(CORE_KERNELS if args.kernels == "core" else []),
        *getattr(args, "extra", []),
    ]


def run_primus(args: argparse.Namespace) -> dict:
    from primus.core.launch.rank import run_rank
    from primus.core.launch.resolve import resolve

    preset = MODELS[args.model][0]
    out = Path(args.workdir)
    overrides = primus_overrides(args, out)
    res = resolve(preset, overrides, world_size=1)
    summary = run_rank(res)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # one row per logging interval: its tokens/s covers that many steps (logging included)
    return {
        "tps": [r["tokens_per_s_per_device"] for r in rows],
        "steps": [r["step"] for r in rows],
        "loss": [r["loss"] for r in rows],
        "mfu": [r.get("mfu") or 0.0 for r in rows],
        "memory_gib": rows[-1]["memory_gib"],
        "status": summary.get("status"),
        "kernels": json.loads((out / "summary.json").read_text()).get("kernels"),
        "kernels_applied": json.loads((out / "summary.json").read_text()).get("kernels_applied"),
        "command": f"primus train {preset} " + shlex.join(overrides),
    }


# ------------------------------------------------------------------------------------------------ driver


def worker(which: str, args: argparse.Namespace, workdir: Path) -> dict:
    """One run in a fresh process; returns its JSON result."""
    result_file = workdir / f"{which}.json"
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        which,
        "--model",
        args.model,
        "--seq",
        str(args.seq),
        "--micro-batch",
        str(args.micro_batch),
        "--steps",
        str(args.steps),
        "--log-interval",
        str(args.log_interval),
        "--kernels",
        args.kernels,
        "--workdir",
        str(workdir),
        "--result",
        str(result_file),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{which} run failed ({proc.returncode}): {shlex.join(cmd)}")
    return json.loads(result_file.read_text())


def main() -> None:
    ap = overhead_args(__doc__, "benchmarks/results/megatron_overhead.json", list(MODELS))
    ap.add_argument("--log-interval", type=int, default=5, help="Primus logging.interval (steps per metrics line)")
    ap.add_argument("--worker", choices=["plain", "primus"], help=argparse.SUPPRESS)
    ap.add_argument(
        "--kernels",
        choices=["auto", "core"],
        default="auto",
        help="Primus kernel selection: auto (turbo's where installed) or core (plain PyTorch: the no-turbo comparison)",
    )
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    args.gpu = torch.cuda.is_available()

    if args.worker:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        result = run_plain(args) if args.worker == "plain" else run_primus(args)
        Path(args.result).write_text(json.dumps(result))
        os._exit(0)  # megatron's checkpoint/async workers and NCCL teardown: nothing left to flush

    rounds, plain, primus = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            plain = worker("plain", args, Path(tmp) / f"plain{r}")
            primus = worker("primus", args, Path(tmp) / f"primus{r}")
            rounds.append(
                {
                    "plain_tokens_per_s": steady(plain["tps"], args.warmup),
                    "primus_tokens_per_s": steady(primus["tps"], args.warmup, primus["steps"]),
                    "plain_loss_last": plain["loss"][-1],
                    "primus_loss_last": primus["loss"][-1],
                    "plain_memory_gib": plain["memory_gib"],
                    "primus_memory_gib": primus["memory_gib"],
                    "primus_mfu": steady(primus["mfu"], args.warmup, primus["steps"]),
                }
            )
            print(json.dumps(rounds[-1]), flush=True)
    plain_tps = statistics.median(r["plain_tokens_per_s"] for r in rounds)
    primus_tps = statistics.median(r["primus_tokens_per_s"] for r in rounds)
    from importlib.metadata import version

    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(0) if args.gpu else "cpu",
        "torch": torch.__version__,
        "megatron_core": version("megatron-core"),
        "model": f"{MODELS[args.model][0]} preset, {plain['params']:,} parameters",
        "seq_len": args.seq,
        "micro_batch_size": args.micro_batch,
        "precision": "bf16 (Float16Module, fp32 main params)" if args.gpu else "fp32",
        "steps": args.steps,
        "warmup_steps_excluded": args.warmup,
        "primus_logging_interval": args.log_interval,
        "plain": "megatron-core GPTModel, local layer spec with core attention swapped for torch SDPA, megatron DDP "
        "+ optimizer, get_forward_backward_func, own loop",
        "primus_command": primus["command"],
        "primus_kernels": primus.get("kernels"),
        "primus_kernel_selection": args.kernels,
        "rounds": rounds,
        "plain_tokens_per_s": plain_tps,
        "primus_tokens_per_s": primus_tps,
        "ratio_primus_over_plain": primus_tps / plain_tps,
        "target_ratio": 1.0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("plain_tokens_per_s", "primus_tokens_per_s", "ratio_primus_over_plain")}))


if __name__ == "__main__":
    main()
