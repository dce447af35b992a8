"""``primus plan``: per-GPU memory and estimated step time of every layout an engine can run, best first."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits", "buffers")
OVERHEAD = ("workspace", "fragmentation", "context")  # shown summed as "overhead"


def plan(
    config: Annotated[str | None, typer.Argument(help="a YAML file or a preset name")] = None,
    overrides: Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides")] = None,
    preset: Annotated[str | None, typer.Option(help="a preset name (instead of CONFIG)")] = None,
    gpus: Annotated[int, typer.Option(help="GPUs per node")] = 8,
    nodes: Annotated[int, typer.Option(help="nodes")] = 1,
    device_name: Annotated[
        str, typer.Option("--device", help="H100, H200, B200, A100, MI300X, MI325X, MI355X")
    ] = "H100",
    gpu_memory: Annotated[float | None, typer.Option(help="GiB per GPU (default: the device's)")] = None,
    engine: Annotated[
        str | None,
        typer.Option(help="an installed backend, planned with its profile (default: backend.name)"),
    ] = None,
    top: Annotated[int, typer.Option(help="layouts shown")] = 10,
) -> None:
    """Rank the parallel layouts that fit: DDP (+ distributed optimizer), FSDP, TP(+SP), PP/VPP, recompute."""
    from primus.core.cli_helpers import _resolve, err, out
    from primus.core.planner import Cluster, candidates, device
    from primus.core.planner.memory import GIB
    from primus.core.planner.profile import backend_spec, load_profile
    from primus.core.strategies import kernel_terms

    if preset and config:  # with --preset, positional words are all overrides
        overrides = [config, *(overrides or [])]
    ref = preset or config
    if ref is None:
        raise typer.BadParameter("give CONFIG or --preset NAME")
    res = _resolve(ref, overrides, world_size=None, check_plugins=False)
    cfg = res.config
    engine = engine or cfg.backend.name
    spec = backend_spec(engine, res.registry)
    try:
        profile = load_profile(spec)
    except (ImportError, AttributeError, TypeError) as exc:  # the backend's planner= is broken
        err.print(f"error: --engine {engine!r}: its planner profile does not load: {exc}", style="red", markup=False)
        raise typer.Exit(2) from None
    if spec is None or spec.planner is None:  # still planned: as the engine that honours every parallel setting
        why = res.registry.missing_backend_message(engine) if spec is None else f"backend {engine!r} gives no profile"
        err.print(
            f"note: {why}; planned as the generic engine (primus.core.planner.profile.GENERIC)",
            style="yellow",
            markup=False,
        )
    try:
        dev = device(device_name, gpu_memory)
    except ValueError as exc:
        err.print(f"error: --device: {exc}", style="red", markup=False)
        raise typer.Exit(2) from None
    cluster = Cluster(dev, nodes, gpus)
    t = cfg.train
    gbs = t.global_batch_size if "train.global_batch_size" in res.layers.sources else None
    k, terms = cfg.kernels, kernel_terms(cfg, res.registry)
    cands = candidates(cfg.model, cluster, t.seq_len, t.micro_batch_size, gbs, profile, t.precision, terms)
    if not cands:
        err.print("error: no layout divides this cluster (check --gpus, --nodes and the global batch)", style="red")
        raise typer.Exit(2)
    fitting = [c for c in cands if c.fits]
    title = (
        f"{cfg.model.name} on {nodes}×{gpus} {dev.name} ({dev.memory_gib:.0f} GiB, {cluster.capacity / GIB:.0f} usable), "
        f"{engine}, seq {t.seq_len}, micro-batch {t.micro_batch_size}, global batch {gbs or 'auto'}"
    )
    if k.fp8 != "off":
        title += f", FP8 {k.fp8} GEMMs in {terms.fp8_layers} of {cfg.model.num_layers} layers"
    cats = (*CATEGORIES, "fp8") if k.fp8 != "off" else CATEGORIES
    table = Table(title=title, box=None)
    for col in ("#", "layout", *cats, "overhead", "total GiB", "step s", "tok/s/GPU", "MFU"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    shown = (fitting or sorted(cands, key=lambda c: c.memory.total))[:top]
    for i, c in enumerate(shown, 1):
        g = c.memory.gib()
        table.add_row(
            str(i),
            c.layout.describe(),
            *(f"{g.get(name, 0.0):.1f}" for name in cats),
            f"{sum(g.get(name, 0.0) for name in OVERHEAD):.1f}",
            f"{c.memory.total / GIB:.1f}",
            f"{c.time.total:.2f}",
            f"{c.tokens_per_s_per_device:,.0f}",
            f"{c.mfu:.1%}",
        )
    out.print(table)
    if not fitting:
        best = shown[0]
        err.print(
            f"error: nothing fits: the smallest layout ({best.layout.describe()}) needs "
            f"{best.memory.total / GIB:.1f} GiB per GPU, {cluster.capacity / GIB:.1f} GiB usable",
            style="red",
            markup=False,
        )
        raise typer.Exit(3)
    fp8_note = f", FP8 {k.fp8}" if k.fp8 != "off" else ""
    out.print(f"recommended: {fitting[0].layout.describe()}{fp8_note}", highlight=False)
