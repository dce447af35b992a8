"""Helpers shared by the GPU benchmarks: medians, model FLOPs, versions, profiler traces and their breakdown."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

PEAK_BF16 = 989e12  # H200 dense bf16, the MFU denominator


def overhead_args(doc: str, out: str, models: list[str]) -> Any:
    """The command line both engine-overhead scripts share (a preset key, the run's shape, the rounds); each adds
    its own options to the returned parser."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out)
    ap.add_argument("--model", choices=sorted(models), default="1b")
    run_shape_args(ap, steps=40, warmup=10)
    ap.add_argument("--rounds", type=int, default=2)
    return ap


def kernel_args(doc: str, smoke: str, **counts: int) -> Any:
    """The parsed command line of a kernel benchmark: ``--out``, ``--smoke`` and an int option per ``counts`` entry
    (its default); without a GPU, Triton's interpreter is selected first (before primus-turbo defines its kernels)."""
    import argparse
    import os

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    for name, default in counts.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--smoke", action="store_true", help=smoke)
    return ap.parse_args()


def run_shape_args(ap: Any, *, steps: int, warmup: int) -> None:
    """``--seq``, ``--micro-batch``, ``--steps`` and ``--warmup``: the shape of every benchmark's training run."""
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=warmup, help="steps left out of each run's median")


def run_overrides(out: Path | str, seq: int, micro: int, steps: int) -> list[str]:
    """What every benchmark's ``primus train`` sets: shape of the run, random tokens, no checkpoints, metrics of
    every step in ``out``/metrics.jsonl and nothing else written."""
    return [
        f"train.seq_len={seq}",
        f"train.micro_batch_size={micro}",
        f"train.steps={steps}",
        "data.source=mock",
        "checkpoint.enabled=false",
        "logging.interval=1",
        "logging.tensorboard=false",
        "logging.progress=false",
        f"logging.output_dir={out}",
    ]


def release() -> None:
    """Between in-process runs: megatron's parallel state (left set up by a run that failed), the process
    group, the cached GPU memory and the peak counter go."""
    import gc
    import sys

    import torch

    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is not None and mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def bench_ms(fn: Any, grads: list[Any], rep: int) -> float:
    """Median ms of ``fn`` (``triton.testing.do_bench`` on a GPU, 3 calls on a CPU); gradients of ``grads`` reset to
    None between calls (no accumulation kernels)."""
    import torch

    if torch.cuda.is_available():
        import triton

        return float(triton.testing.do_bench(fn, rep=rep, grad_to_none=grads, return_mode="median"))
    times = []
    for _ in range(3):
        for g in grads:
            g.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def clear_grads(inputs: list[Any]) -> None:
    for x in inputs:
        x.grad = None


def time_autograd(fn: Any, inputs: list[Any], dout: Any, warmup: int, iters: int) -> dict[str, Any]:
    """Median fwd and fwd+bwd (ms) of ``fn(*inputs)`` with ``out.backward(dout)``, CUDA events, grads cleared."""
    import torch

    for _ in range(warmup):
        clear_grads(inputs)
        fn(*inputs).backward(dout)
    torch.cuda.synchronize()
    fwd, both = [], []
    for _ in range(iters):
        clear_grads(inputs)
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        out = fn(*inputs)
        e1.record()
        out.backward(dout)
        e2.record()
        torch.cuda.synchronize()
        fwd.append(e0.elapsed_time(e1))
        both.append(e0.elapsed_time(e2))
        del out
    return {
        "fwd_ms": statistics.median(fwd),
        "fwd_bwd_ms": statistics.median(both),
        "bwd_ms": statistics.median(b - f for f, b in zip(fwd, both, strict=True)),
        "fwd_bwd_ms_all": [round(x, 3) for x in both],
    }


def steady(values: list[float], warmup: int, steps: list[int] | None = None, last: int | None = None) -> float:
    """Median of the values of steps ``warmup + 1 .. last`` (``steps``: the last step each value covers)."""
    steps = steps or list(range(1, len(values) + 1))
    last = last or max(steps)
    return statistics.median(v for v, s in zip(values, steps, strict=True) if warmup < s <= last)


def flops_per_token(shape: dict[str, Any], seq: int) -> float:
    """Training FLOPs a token of a Llama-like model: 6 x (matmul parameters, the output head included, the
    input embedding not) + 12 x layers x (heads x head dim) x seq for attention (no causal discount), as in
    results/h200_baseline.md. ``shape``: layers, dim, heads, kv_heads, head_dim, ffn, vocab."""
    attn_width = shape["heads"] * shape["head_dim"]
    kv_width = shape["kv_heads"] * shape["head_dim"]
    per_layer = shape["dim"] * (2 * attn_width + 2 * kv_width) + 3 * shape["dim"] * shape["ffn"]
    matmul = shape["layers"] * per_layer + shape["vocab"] * shape["dim"]
    return 6 * matmul + 12 * shape["layers"] * attn_width * seq


def rel(a: Any, b: Any) -> float:
    """Relative Frobenius error of tensor ``a`` against the reference ``b``, in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for dist in ("triton", "megatron-core", "torchtitan", "primus-core", "primus-turbo"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


class LastStepsProfiler:
    """torch.profiler over the last ``active`` of ``steps`` steps (one warm-up step before them); the Chrome
    trace lands in ``path``. Call :meth:`step` after each step."""

    def __init__(self, path: Path | None, steps: int, active: int = 2) -> None:
        self._prof = None
        if path is None:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        path.parent.mkdir(parents=True, exist_ok=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(
            activities=acts,
            schedule=schedule(wait=max(0, steps - active - 1), warmup=1, active=active, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
        )
        self._prof.__enter__()

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None


def breakdown(trace: Path | None) -> dict[str, Any] | None:
    """GEMM / attention / other shares of the traced device time (primus.core.profile.analyze), the step
    time and the top 20 kernels (ms summed over the traced steps) with their category; None without a trace."""
    if trace is None or not trace.is_file():
        return None
    from primus.core.profile.analyze import analyze_files, categorize

    report = analyze_files([trace], top_n=20)[0]
    busy = sum(report.categories.values()) or 1.0
    return {
        "traced_steps": report.steps,
        "step_ms": report.step_us / 1e3,
        "idle_share": report.shares()["idle"],
        "kernel_time_shares": {k: round(v / busy, 4) for k, v in report.categories.items()},
        "top_kernels": [
            {"name": n[:120], "category": categorize(n), "ms": round(t / 1e3, 3), "calls": c} for n, t, c in report.top
        ],
    }


def plain_gpt_parts(gpu: bool, bf16: bool, **dims: Any) -> tuple[Any, Any]:
    """megatron-core's own TransformerConfig (a Llama-style model: RMSNorm, SwiGLU, no biases, no dropout; ``dims``
    gives the sizes) and local layer spec with torch SDPA as core attention (megatron's local one materialises the
    [b, h, s, s] scores): the plain megatron-core model of the benchmarks that compare with it."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        """Core attention through torch SDPA: [s, b, h, d] in, [s, b, h·d] out; causal, GQA."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):  # fmt: skip
            super().__init__(config=config)
            self.scale = softmax_scale

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):  # fmt: skip
            s, b = query.shape[:2]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=k.shape[1] != q.shape[1]
            )
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        init_method_std=0.02,
        **({} if gpu else {"batch_p2p_comm": False}),
        **dims,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return config, spec
