"""Why megatron-core 0.16.1's own FSDP (``FullyShardedDataParallel``, "Megatron FSDP") reports a larger gradient norm
than megatron DDP on one GPU: the same tiny GPTModel, weights and batches, through DDP + distributed optimizer and
through Megatron FSDP, against a gradient norm computed by hand with plain torch autograd.

    python benchmarks/megatron_fsdp_gradnorm.py --out benchmarks/results/megatron_fsdp_gradnorm.json

(on the lent H200: ``torchrun --nproc-per-node 1`` works too; the driver starts one fresh single-rank process per
variant either way, since wrapping a model in DDP / FSDP is not reversible and megatron keeps global state).

Imports megatron.core and torch only. Model: GPTModel, 4 layers, hidden 256, 4 heads (kv 64), SwiGLU ffn 1024,
RMSNorm, RoPE, vocab 1024, seq 128, micro-batch 2, megatron's local layer spec (``get_gpt_layer_local_spec``) with
core attention through torch SDPA (causal); bf16 (Float16Module, fp32 main params, fp32 grad reduction) unless a
variant says fp32. Uniform random tokens, seed 0; weights seeded 1234 (a checksum of the initial weights is
recorded per variant). Adam, lr 1e-4, clip 1.0; a few steps with ``get_forward_backward_func`` and M micro-batches.

Per variant and step: megatron's loss and the grad norm its optimizer returns, the norm of the gradients the
optimizer sees computed by hand, and at step 1 the reference from plain autograd on the unwrapped model (mean loss
over the global batch: each micro-batch's mean / M, summed), the relative distance of the optimizer's gradient
from it, and from two predictions of the suspected bug (see ``PREDICTIONS``).

The suspected cause (megatron-core 0.16.1, distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py): with a
data-parallel group of size 1 the main grad buffer is not "distributed" (``is_data_distributed=... and
main_buf_dp_group.size() > 1``), so ``fetch_bucket`` hands back a view of the buffer itself and ``_grad_acc``
(megatron_fsdp.py) adds each micro-batch's gradient into it; ``GradReducePipeline._bucket_group_gradient_reduce``
still reduce-scatters that bucket into a fresh tensor and then does ``local_grad += reduced_grad`` with
``local_grad`` the same memory: the buffer doubles at every reduction. With ``optim_grads`` / ``optim_grads_params``
a reduction follows every micro-batch's backward, so after M micro-batches the gradient is sum_k 2^(M-k+1) g_k.
The ``fsdp_*_halved`` variants undo the doubling after each reduction (exact at dp = 1 only) to check that nothing
else differs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from primus.core.launch.env import free_port

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQ, MBS = 4, 256, 4, 1024, 1024, 128, 2
LR, CLIP = 1e-4, 1.0

# name -> (wrapper, sharding strategy, micro-batches, precision, tied embeddings, halve after each reduction)
VARIANTS: dict[str, tuple] = {}
for _m in (1, 4, 8):
    VARIANTS[f"ddp_mb{_m}"] = ("ddp", None, _m, "bf16", False, False)
    VARIANTS[f"fsdp_optim_grads_params_mb{_m}"] = ("fsdp", "optim_grads_params", _m, "bf16", False, False)
for _m in (1, 4):
    for _s in ("optim_grads", "optim", "no_shard"):
        VARIANTS[f"fsdp_{_s}_mb{_m}"] = ("fsdp", _s, _m, "bf16", False, False)
    VARIANTS[f"fsdp_optim_grads_params_halved_mb{_m}"] = ("fsdp", "optim_grads_params", _m, "bf16", False, True)
VARIANTS["ddp_fp32_mb4"] = ("ddp", None, 4, "fp32", False, False)
VARIANTS["fsdp_optim_grads_params_fp32_mb4"] = ("fsdp", "optim_grads_params", 4, "fp32", False, False)
VARIANTS["ddp_tied_mb1"] = ("ddp", None, 1, "bf16", True, False)
VARIANTS["fsdp_optim_grads_params_tied_mb1"] = ("fsdp", "optim_grads_params", 1, "bf16", True, False)

PREDICTIONS = {
    "doubling_every_backward": "sum_k 2^(M-k+1) g_k: the buffer doubles after each micro-batch's reduction "
    "(optim_grads, optim_grads_params)",
    "doubling_once": "2 * sum_k g_k: one reduction after the last micro-batch (optim, with M > 1)",
}


# ------------------------------------------------------------------------------------------------ worker


def run_variant(name: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    wrapper, strategy, num_micro, precision, tied, halved = VARIANTS[name]
    t_start = time.time()

    def mark(what: str) -> None:
        print(f"[{name} {time.time() - t_start:.1f}s] {what}", flush=True)

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if gpu else "gloo")
    mark("process group up")
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        FullyShardedDataParallel,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    if halved:
        from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import GradReducePipeline

        original = GradReducePipeline._bucket_group_gradient_reduce

        def halved_reduce(self, bucket_group, async_op=False, outer_fsdp_group_grad_reduce=False):
            out = original(self, bucket_group, async_op=async_op,
                           outer_fsdp_group_grad_reduce=outer_fsdp_group_grad_reduce)  # fmt: skip
            if self.buffer.ddp_config.data_parallel_sharding_strategy != "no_shard":
                torch.cuda.synchronize()
                for bucket_id in bucket_group:
                    gbuf = self.get_fsdp_buffer(bucket_id)
                    if not gbuf.is_data_distributed:
                        # the reduction left buffer = buffer + reduce_scatter(buffer) = 2x at dp = 1
                        gbuf.get_shard_from_local_buffer().mul_(0.5)
            return out

        GradReducePipeline._bucket_group_gradient_reduce = halved_reduce

    bf16 = precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    dev = torch.cuda.current_device() if gpu else "cpu"
    parallel_state.initialize_model_parallel()
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    from _common import plain_gpt_parts

    config, spec = plain_gpt_parts(
        gpu,
        bf16,
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        kv_channels=HIDDEN // HEADS,
        ffn_hidden_size=FFN,
    )
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied,
                     position_embedding_type="rope").to(dev)  # fmt: skip
    if bf16:
        model = Float16Module(config, model)
    with torch.no_grad():
        init_checksum = float(sum(p.double().pow(2).sum() for p in model.parameters()))
    n_params = sum(p.numel() for p in model.parameters())

    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (steps, num_micro, MBS, SEQ + 1), generator=gen)

    def strip(n: str) -> str:
        while n.startswith("module."):
            n = n[len("module.") :]
        return n

    # ---- reference at step 1: plain autograd on the unwrapped model, mean loss over the global batch
    per_micro, ref_losses = [], []
    for k in range(num_micro):
        model.zero_grad(set_to_none=True)
        b = data[0, k].to(dev)
        out = model(b[:, :-1], None, None, labels=b[:, 1:])
        loss = out.float().mean()
        (loss / num_micro).backward()
        ref_losses.append(loss.item())
        per_micro.append({strip(n): p.grad.detach().float().clone() for n, p in model.named_parameters()
                          if p.grad is not None})  # fmt: skip
    model.zero_grad(set_to_none=True)
    names = list(per_micro[0])
    ref = {n: sum(g[n] for g in per_micro) for n in names}
    pred_every = {n: sum(2.0 ** (num_micro - k) * per_micro[k][n] for k in range(num_micro)) for n in names}
    pred_once = {n: 2.0 * ref[n] for n in names}

    def norm(grads: dict) -> float:
        return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))

    reference = {
        "loss": sum(ref_losses) / num_micro,
        "grad_norm": norm(ref),
        "grad_norm_torch_get_total_norm": float(torch.nn.utils.get_total_norm(list(ref.values()))),
        "predicted_grad_norm": {"doubling_every_backward": norm(pred_every), "doubling_once": norm(pred_once)},
    }

    mark("reference done")
    # ---- wrap
    if wrapper == "ddp":
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        wrapped = DistributedDataParallel(config, ddp_config, model)
    else:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=True,
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy=strategy,
            overlap_grad_reduce=strategy in ("optim_grads", "optim_grads_params"),
            overlap_param_gather=strategy == "optim_grads_params",
        )
        wrapped = FullyShardedDataParallel(config, ddp_config, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            weight_decay=0.0,
            clip_grad=CLIP,
            bf16=bf16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
        ),  # fmt: skip
        [wrapped],
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = wrapped.no_sync
    mark("wrapped, optimizer built")
    fb = get_forward_backward_func()

    def forward_step(it, m):
        b = next(it).to(dev)
        out = m(b[:, :-1], None, None, labels=b[:, 1:])
        return out, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})

    def optimizer_grads() -> dict:
        """The gradients the optimizer's norm is taken over (full tensors at dp = 1), by parameter name."""
        if wrapper == "ddp":
            return {strip(n): p.main_grad.detach().float() for n, p in wrapped.module.named_parameters()
                    if getattr(p, "main_grad", None) is not None}  # fmt: skip
        from megatron.core.utils import to_local_if_dtensor

        named = wrapped.module.param_and_grad_buffer.optimizer_named_parameters
        return {strip(n): to_local_if_dtensor(p.grad).detach().float() for n, p in named if p.grad is not None}

    rows = []
    for step in range(steps):
        wrapped.zero_grad_buffer()
        opt.zero_grad()
        out = fb(forward_step_func=forward_step, data_iterator=iter(list(data[step])), model=[wrapped],
                 num_microbatches=num_micro, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)  # fmt: skip
        grads = optimizer_grads()
        row = {
            "step": step + 1,
            "loss": sum(float(x["lm loss"]) for x in out) / num_micro,
            "grad_norm_by_hand": norm(grads),
        }
        if step == 0:
            missing = sorted(set(names) - set(grads))

            def rel(target: dict, grads: dict = grads) -> float:
                num = sum(float((grads[n].reshape(-1) - target[n].reshape(-1)).double().pow(2).sum())
                          for n in names if n in grads)  # fmt: skip
                return math.sqrt(num) / norm(target)

            ratios = sorted(
                math.sqrt(float(grads[n].double().pow(2).sum()) / max(float(ref[n].double().pow(2).sum()), 1e-300))
                for n in names if n in grads
            )  # fmt: skip
            row["vs_reference"] = {
                "relative_distance_to_reference": rel(ref),
                "relative_distance_to_prediction": {
                    "doubling_every_backward": rel(pred_every),
                    "doubling_once": rel(pred_once),
                },  # fmt: skip
                "per_parameter_norm_ratio": {
                    "min": ratios[0],
                    "median": ratios[len(ratios) // 2],
                    "max": ratios[-1],
                    "count": len(ratios),
                },  # fmt: skip
                "missing_parameters": missing,
            }
        ok, grad_norm, _ = opt.step()
        row["grad_norm"] = float(grad_norm) if grad_norm is not None else None
        row["update_successful"] = bool(ok)
        rows.append(row)
        print(name, json.dumps({k: v for k, v in row.items() if k != "vs_reference"}), flush=True)

    return {
        "variant": name,
        "wrapper": "megatron DistributedDataParallel + DistributedOptimizer"
        if wrapper == "ddp"
        else "megatron FullyShardedDataParallel (Megatron FSDP) + DistributedOptimizer",  # fmt: skip
        "data_parallel_sharding_strategy": strategy,
        "micro_batches": num_micro,
        "precision": precision,
        "tied_embeddings": tied,
        "halved_after_each_reduction": halved,
        "ddp_config": {
            k: getattr(ddp_config, k)
            for k in (
                "use_megatron_fsdp",
                "data_parallel_sharding_strategy",
                "use_distributed_optimizer",
                "overlap_grad_reduce",
                "overlap_param_gather",
                "grad_reduce_in_fp32",
                "average_in_collective",
            )
        },  # fmt: skip
        "params": n_params,
        "init_checksum": init_checksum,
        "reference_step1": reference,
        "steps": rows,
        "ratio_step1_grad_norm_over_reference": rows[0]["grad_norm"] / reference["grad_norm"],
    }


# ------------------------------------------------------------------------------------------------ driver


def spawn(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    """One variant in a fresh single-rank process group of its own (its own port; torchrun's agent store, which
    TORCHELASTIC_USE_AGENT_STORE would make env:// join, is not passed on)."""
    result, log_file = tmp / f"{name}.json", tmp / f"{name}.log"
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC_")}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")  # fmt: skip
    cmd = [sys.executable, __file__, "--worker", name, "--steps", str(args.steps), "--result", str(result)]
    t0 = time.time()
    with open(log_file, "w") as f:  # a file, not a pipe: a worker that times out still leaves its output
        try:
            rc = subprocess.run(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.worker_timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    log = log_file.read_text(errors="replace")
    if rc == 0 and result.exists():
        out = json.loads(result.read_text())
        out["wall_s"] = round(time.time() - t0, 1)
        return out
    lines = [ln for ln in log.splitlines() if ln.strip() and "warn" not in ln.lower()]
    err = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
    return {"variant": name, "failed": True, "returncode": rc, "error": err, "log_tail": "\n".join(lines[-40:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/megatron_fsdp_gradnorm.json")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--parallel", type=int, default=6, help="variant processes at a time (one GPU, tiny model)")
    ap.add_argument("--worker-timeout", type=float, default=240)
    ap.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        out = run_variant(args.worker, args.steps)
        Path(args.result).write_text(json.dumps(out))
        os._exit(0)  # NCCL teardown: nothing left to flush
    if int(os.environ.get("RANK", "0")) != 0:
        return
    t0 = time.time()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        futures = {pool.submit(spawn, n, args, Path(tmp)): n for n in args.variants}
        for fut in as_completed(futures):
            results[futures[fut]] = fut.result()
            write(args, {n: results[n] for n in args.variants if n in results}, t0, final=len(results) == len(futures))


def write(args: argparse.Namespace, results: dict, t0: float, final: bool) -> None:
    """The JSON, rewritten as each variant finishes (a run cut short still leaves what it measured)."""
    import torch

    def gn(name: str, step: int = 0):
        r = results.get(name)
        return None if not r or r.get("failed") else r["steps"][step]["grad_norm"]

    summary = {}
    for name, r in results.items():
        if r.get("failed"):
            summary[name] = {"failed": r["error"]}
            continue
        ddp = f"ddp_mb{r['micro_batches']}" if r["precision"] == "bf16" and not r["tied_embeddings"] else (
            "ddp_fp32_mb4" if r["precision"] == "fp32" else "ddp_tied_mb1")  # fmt: skip
        s1 = r["steps"][0]
        summary[name] = {
            "grad_norm_per_step": [s["grad_norm"] for s in r["steps"]],
            "loss_per_step": [s["loss"] for s in r["steps"]],
            "reference_grad_norm_step1": r["reference_step1"]["grad_norm"],
            "ratio_over_reference_step1": r["ratio_step1_grad_norm_over_reference"],
            "ratio_over_ddp_step1": (s1["grad_norm"] / gn(ddp)) if gn(ddp) and ddp != name else None,
            "predicted_ratio_doubling_every_backward": r["reference_step1"]["predicted_grad_norm"][
                "doubling_every_backward"
            ]
            / r["reference_step1"]["grad_norm"],  # fmt: skip
            "relative_distance_to_reference_step1": s1["vs_reference"]["relative_distance_to_reference"],
            "relative_distance_to_prediction_step1": s1["vs_reference"]["relative_distance_to_prediction"],
            "optimizer_norm_over_hand_norm_step1": s1["grad_norm"] / s1["grad_norm_by_hand"],
        }
    doc = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "complete": final,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "megatron_core": importlib.metadata.version("megatron-core"),
        "model": f"GPTModel {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, ffn {FFN} (SwiGLU), vocab {VOCAB}, "
        f"seq {SEQ}, micro-batch {MBS}; local layer spec with SDPA core attention; RMSNorm, RoPE",
        "optimizer": f"megatron DistributedOptimizer (Adam, lr {LR}, clip {CLIP}); grad_norm is what opt.step() returns",
        "reference": "plain torch autograd on the unwrapped model before wrapping: sum over micro-batches of "
        "(micro-batch mean loss / M), norm = sqrt(sum g^2) (and torch.nn.utils.get_total_norm)",
        "predictions": PREDICTIONS,
        "data_parallel_size": 1,
        "summary": summary,
        "variants": results,
        "wall_s": round(time.time() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    if final:
        for name, s in summary.items():
            print(name, json.dumps(s if "failed" in s else {k: s[k] for k in (
                "grad_norm_per_step", "reference_grad_norm_step1", "ratio_over_reference_step1", "ratio_over_ddp_step1",
                "predicted_ratio_doubling_every_backward", "relative_distance_to_prediction_step1")}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
