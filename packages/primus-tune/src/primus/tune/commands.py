"""``primus tune gemm record|run|show`` and ``primus benchmark gemm|attention``.

Mounted by core through the ``primus_commands`` hook. Nothing heavy at module level: torch is imported inside
the commands, so ``primus --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

tune_app = typer.Typer(help="Tuning: GEMM shapes, search and results.", no_args_is_help=True)
gemm_app = typer.Typer(help="GEMM tuning: record a model's shapes, search them, show results.", no_args_is_help=True)
benchmark_app = typer.Typer(help="Kernel benchmarks on this machine.", no_args_is_help=True)
tune_app.add_typer(gemm_app, name="gemm")

out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, soft_wrap=True)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
Overrides = Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides, applied last")]


def _fail(msg: str, code: int = 2) -> typer.Exit:
    err.print(f"error: {msg}", style="red", highlight=False, markup=False)
    return typer.Exit(code)


def _config(config: str, overrides: list[str] | None):
    from primus.core.config.errors import ConfigError
    from primus.core.launch.resolve import resolve

    try:
        return resolve(config, overrides or [], check_plugins=False).config
    except ConfigError as exc:
        raise _fail(str(exc)) from None


def _platform() -> str:
    from primus.core.kernels.selection import detect_device

    return detect_device()


def _config_shapes(cfg: Any, device: str):
    """One recorded forward + backward of the config's model (see primus.tune.model): the recorder."""
    import torch

    from primus.tune.model import step_gemms

    return step_gemms(
        cfg.model,
        micro_batch=cfg.train.micro_batch_size,
        seq_len=cfg.train.seq_len,
        dtype=getattr(torch, DTYPES[cfg.train.precision]),
        device=device,
        tp=cfg.parallel.tp,
        cp=cfg.parallel.cp,
        fused=cfg.backend.name == "megatron",
    )


def _record_device(device: str, cfg: Any) -> str:
    """``auto``: a real step on the GPU when the model (weights, grads, activations: ~4 bytes/param counted twice)
    fits in half its free memory; else ``meta`` (same shapes, no compute: the recorder needs no numbers)."""
    if device != "auto":
        return device
    if _platform() == "cpu":
        return "meta"
    import torch

    from primus.core.planner.modelmath import count_params

    free, _ = torch.cuda.mem_get_info()
    return "cuda" if 8 * count_params(cfg.model).total < free / 2 else "meta"


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


# ------------------------------------------------------------------------------------------------ tune gemm


@gemm_app.command("record")
def record(
    config: Annotated[str, typer.Argument(help="a YAML file or a preset name")],
    overrides: Overrides = None,
    out_file: Annotated[
        Path | None, typer.Option("--out", help="shapes file (default: beside the results file)")
    ] = None,
    device: Annotated[
        str, typer.Option(help="auto (the GPU if the model fits, else meta: shapes without compute), cpu, cuda, meta")
    ] = "auto",
) -> None:
    """Run one forward + backward of the config's model and record every GEMM (sizes, layouts, dtypes, counts)."""
    from primus.tune.gemm import default_results_file
    from primus.tune.record import save_shapes

    cfg = _config(config, overrides)
    dev = _record_device(device, cfg)
    rec = _config_shapes(cfg, dev)
    path = out_file or default_results_file(cfg.model_dump(mode="json")).with_suffix(".shapes.json")
    source = {
        "config": config,
        "model": cfg.model.name,
        "backend": cfg.backend.name,
        "tokens": cfg.train.micro_batch_size * cfg.train.seq_len // cfg.parallel.cp,
        "micro_batch_size": cfg.train.micro_batch_size,
        "seq_len": cfg.train.seq_len,
        "tp": cfg.parallel.tp,
        "cp": cfg.parallel.cp,
        "precision": cfg.train.precision,
        "device": dev,
    }
    save_shapes(path, rec.records, source)
    _shapes_table([r.to_dict() for r in rec.records])
    err.print(f"{len(rec.records)} GEMM shapes ({sum(r.count for r in rec.records)} calls per step) -> {path}")


@gemm_app.command("run")
def run(
    shapes_file: Annotated[Path, typer.Argument(help="a shapes file from `primus tune gemm record`")],
    out_file: Annotated[Path | None, typer.Option("--out", help="results file (default: SHAPES minus .shapes)")] = None,
    budget: Annotated[int, typer.Option(help="candidate algorithms per shape (cuBLASLt heuristics)")] = 32,
    iterations: Annotated[int, typer.Option(help="autotune / TunableOp tuning iterations per shape")] = 50,
    repeats: Annotated[int, typer.Option(help="interleaved default-vs-tuned rounds (medians compared)")] = 30,
    min_gain: Annotated[float, typer.Option(help="fraction the tuned GEMM must win by")] = 0.01,
    max_seconds: Annotated[float | None, typer.Option(help="wall-clock cap over all shapes")] = None,
) -> None:
    """Search every recorded shape on this GPU; write default vs tuned TF/s, the chosen solution and the winner."""
    from primus.tune.record import load_shapes
    from primus.tune.results import GemmResults, current_environment
    from primus.tune.searchers import NoSearcher, SearchBudget, select_searcher

    try:
        records, source = load_shapes(shapes_file)
        searcher = select_searcher(_platform())
    except (ValueError, FileNotFoundError, NoSearcher) as exc:
        raise _fail(str(exc)) from None
    plan = SearchBudget(
        limit=budget, iterations=iterations, repeats=repeats, min_gain=min_gain, max_seconds=max_seconds
    )
    results = GemmResults(current_environment(), searcher=searcher.name, extra={"shapes": source})
    for entry in searcher.tune([r.shape for r in records], plan):
        results.add(entry)
    if searcher.name == "tunableop":
        results.extra["tunableop_validators"] = searcher.validators()
    path = out_file or Path(str(shapes_file).replace(".shapes.json", ".json"))
    if path == shapes_file:
        path = shapes_file.with_suffix(".results.json")
    results.save(path)
    _results_table(results)
    err.print(f"-> {path}")


@gemm_app.command("show")
def show(file: Annotated[Path, typer.Argument(help="a results file (or a shapes file)")]) -> None:
    """List the shapes of a results file with default and tuned TF/s, gain, winner and solution."""
    from primus.tune.results import read_results

    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise _fail(f"{file}: {exc}") from None
    if str(data.get("format", "")).startswith("primus-gemm-shapes"):
        _shapes_table(data["gemms"])
        return
    try:
        results = read_results(file)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    env = results.environment
    out.print(
        f"{env.device} ({env.platform} {env.runtime}, {env.blas}, torch {env.torch}), searcher {results.searcher}"
    )
    _results_table(results)


def _shapes_table(gemms: list[dict[str, Any]]) -> None:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("op", "layout", "m", "n", "k", "batch", "dtype", "bias", "count", "phases"):
        table.add_column(col, justify="right" if col in ("m", "n", "k", "batch", "count") else "left")
    for g in gemms:
        table.add_row(
            g["op"],
            g["layout"],
            str(g["m"]),
            str(g["n"]),
            str(g["k"]),
            str(g.get("batch", 1)),
            g["dtype"],
            "yes" if g.get("bias") else "",
            str(g.get("count", "")),
            ",".join(g.get("phases", [])),
        )
    out.print(table)


def _solution_text(solution: Any) -> str:
    if isinstance(solution, dict):
        if "algorithm_id" in solution:
            return f"cuBLASLt algo {solution['algorithm_id']} (#{solution.get('heuristic_index')})"
        if "solution" in solution:
            return str(solution["solution"])
    return "" if solution is None else str(solution)[:40]


def _results_table(results: Any) -> None:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("shape", "default TF/s", "tuned TF/s", "gain", "winner", "solution / note"):
        table.add_column(col, justify="right" if "TF/s" in col or col == "gain" else "left")
    for key, e in sorted(results.entries.items(), key=lambda kv: kv[1].shape):
        gain = e.gain
        table.add_row(
            key,
            _fmt(e.default_tflops or None),
            _fmt(e.tuned_tflops),
            "-" if gain is None else f"{gain * 100:+.1f}%",
            e.winner,
            e.note or _solution_text(e.solution),
        )
    out.print(table)
    tuned = results.tuned()
    out.print(f"{len(results.entries)} shapes, tuned algorithm kept for {len(tuned)}")


# ------------------------------------------------------------------------------------------------ benchmark


@benchmark_app.command("gemm")
def benchmark_gemm(
    config: Annotated[str | None, typer.Argument(help="a YAML file or preset: its model's GEMM shapes")] = None,
    overrides: Overrides = None,
    shape: Annotated[list[str] | None, typer.Option(help="m,n,k[,LAYOUT] (repeatable) instead of a config")] = None,
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32 (for --shape)")] = "bf16",
    budget: Annotated[int, typer.Option(help="candidate algorithms per shape")] = 16,
    repeats: Annotated[int, typer.Option(help="interleaved rounds")] = 15,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """Default vs tuned TF/s for a model's GEMM shapes or the given ones (default only where no searcher runs)."""
    from primus.tune.results import GemmResults, current_environment
    from primus.tune.searchers import NoSearcher, SearchBudget, select_searcher
    from primus.tune.shapes import parse_shape

    if shape:
        try:
            shapes = [parse_shape(s, dtype=DTYPES[dtype]) for s in shape]
        except (ValueError, KeyError) as exc:
            raise _fail(f"--shape/--dtype: {exc}") from None
    elif config:
        shapes = [r.shape for r in _config_shapes(_config(config, overrides), "meta").records]
    else:
        raise _fail("give a CONFIG or --shape m,n,k")
    platform = _platform()
    plan = SearchBudget(limit=budget, repeats=repeats)
    results = GemmResults(current_environment())
    try:
        searcher = select_searcher(platform)
        results.searcher = searcher.name
        entries = searcher.tune(shapes, plan)
    except NoSearcher as exc:
        err.print(f"no tuning here: {exc}", highlight=False)
        entries = [_default_entry(s, platform, plan) for s in shapes]
    for e in entries:
        results.add(e)
    _results_table(results)
    if json_out:
        results.save(json_out)


def _default_entry(shape: Any, platform: str, plan: Any):
    import torch

    from primus.tune.bench import interleaved_medians, operands, tflops
    from primus.tune.results import TuningEntry

    device = "cpu" if platform == "cpu" else "cuda"
    a, b = operands(shape, device)
    ms = interleaved_medians({"default": lambda: torch.mm(a, b)}, device=device, repeats=plan.repeats, inner=2)
    return TuningEntry(shape, tflops(shape, ms["default"]), note="default only (no searcher on this device)")


@benchmark_app.command("attention")
def benchmark_attention(
    batch: Annotated[int, typer.Option(help="batch")] = 1,
    seq: Annotated[int, typer.Option(help="sequence length")] = 4096,
    heads: Annotated[int, typer.Option(help="query heads")] = 32,
    kv_heads: Annotated[int, typer.Option(help="key/value heads")] = 8,
    head_dim: Annotated[int, typer.Option(help="head dim")] = 128,
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    repeats: Annotated[int, typer.Option(help="interleaved rounds")] = 10,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """Each attention provider available here (core's registry): causal forward and forward+backward TF/s."""
    from primus.core.contracts.plugins import get_registry
    from primus.tune.attention import benchmark_providers

    rows = benchmark_providers(
        batch=batch,
        seq=seq,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=DTYPES[dtype],
        repeats=repeats,
        platform=_platform(),
        registry=get_registry(),
    )
    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("provider", "package", "fwd TF/s", "fwd+bwd TF/s", "note"):
        table.add_column(col, justify="right" if "TF/s" in col else "left")
    for r in rows:
        table.add_row(r["provider"], r["package"], _fmt(r.get("fwd_tflops")), _fmt(r.get("fwd_bwd_tflops")), r["note"])
    out.print(table)
    if json_out:
        json_out.write_text(json.dumps(rows, indent=1) + "\n")
