"""``primus plan``: per-GPU memory and estimated step time of every layout an engine can run, best first.

The config is read at the cluster's world size (``--gpus`` × ``--nodes``); only layouts that fit within the usable
memory less ``--headroom`` and that the engine's backend accepts (its own validation) are ranked, each with its fastest
micro-batch (:mod:`primus.core.launch.cluster_plan`)."""

from __future__ import annotations

from collections import Counter
from typing import Annotated

import typer
from rich.table import Table

from primus.core.planner.calibration import HEADROOM

#: ``--engine generic``: plan core's generic engine (:data:`primus.core.planner.engine_profile.GENERIC`) by name. Primus's own
#: engines not installed here are planned as it too (and said so); any other name no backend has is refused.
GENERIC_ENGINE = "generic"

#: the sequence length a config that sets none (a model preset) is planned at, or the model's context if shorter
PRESET_SEQ_LEN = 8192

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits", "buffers")
OVERHEAD = ("workspace", "fragmentation", "context")  # shown summed as "overhead"


def plan(
    config: Annotated[str | None, typer.Argument(help="a YAML file or a preset name")] = None,
    overrides: Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides")] = None,
    preset: Annotated[str | None, typer.Option(help="a preset name (instead of CONFIG)")] = None,
    gpus: Annotated[
        int | None, typer.Option(min=1, help="GPUs per node [default: the recipe's cluster, else 8]")
    ] = None,
    nodes: Annotated[int | None, typer.Option(min=1, help="nodes [default: the recipe's cluster, else 1]")] = None,
    device_name: Annotated[
        str | None,
        typer.Option(
            "--device", help="H100, H200, B200, A100, MI300X, MI325X, MI355X [default: the recipe's cluster, else H100]"
        ),
    ] = None,
    gpu_memory: Annotated[float | None, typer.Option(help="GiB per GPU (default: the device's)")] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            help="an installed backend, planned with its profile (default: backend.name); generic: core's generic engine"
        ),
    ] = None,
    top: Annotated[int, typer.Option(help="layouts shown")] = 10,
    headroom: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=0.9,
            help="share of the usable memory a layout must leave free (default: the memory model's error band)",
        ),
    ] = HEADROOM,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="one JSON object on stdout: every layout shown, with the overrides that give it"),
    ] = False,
) -> None:
    """Rank the parallel layouts that fit and the engine accepts: DDP (+ distributed optimizer), FSDP, TP(+SP), PP/VPP,
    recompute, each with its fastest micro-batch (set train.micro_batch_size=N to fix it), and the overrides that run
    it. Exit 3: nothing fits; 4: the engine refuses every layout that fits."""
    from primus.core.cli.helpers import err, fail, out
    from primus.core.config.errors import ConfigError
    from primus.core.contracts.plugins import KNOWN_BACKEND_DISTS
    from primus.core.launch.cluster_plan import ANY_LAYOUT, global_batch, rank, resolve_on
    from primus.core.launch.resolve import searched_micro_batches
    from primus.core.planner import Cluster, device
    from primus.core.planner.auto import layout_overrides
    from primus.core.planner.engine_profile import backend_spec, load_profile
    from primus.core.planner.memory import GIB
    from primus.core.planner.strategies import kernel_terms

    if preset and config:  # with --preset, positional words are all overrides
        overrides = [config, *(overrides or [])]
    ref = preset or config
    if ref is None:
        raise typer.BadParameter("give CONFIG or --preset NAME")
    cluster_of = recipe_cluster(ref, overrides or [])  # what the recipe was written for fills what is not given
    gpus = gpus or (cluster_of.gpus_per_node if cluster_of else 8)
    nodes = nodes or (cluster_of.nodes if cluster_of else 1)
    device_name = device_name or (cluster_of.device if cluster_of and cluster_of.device else "H100")
    try:
        res, own = resolve_on(ref, overrides or [], gpus * nodes)
    except ConfigError as exc:
        raise fail(exc) from None
    seq_words: list[str] = []
    if res.layers.sources.get("train.seq_len") is None:  # a model preset: plan at a training length, not 128
        seq = min(res.config.model.max_position_embeddings, PRESET_SEQ_LEN)
        seq_words.append(f"train.seq_len={seq}")
        overrides = [*(overrides or []), f"train.seq_len={seq}"]
        err.print(f"note: no train.seq_len in the config: planned at {seq} (set train.seq_len=N)", markup=False)
        try:
            res, own = resolve_on(ref, overrides, gpus * nodes)
        except ConfigError as exc:
            raise fail(exc) from None
    cfg = res.config
    # words the plan adds to the user's (each layout's overrides repeat them: they make the run that was planned)
    added = [*(ANY_LAYOUT if own else ()), *seq_words]
    if own:  # a recipe written for another cluster: its layout does not run here, the others are planned all the same
        err.print(
            f"note: the config's own layout does not run on {nodes}×{gpus} GPUs ("
            + "; ".join(str(issue) for issue in own)
            + "); planning every layout",
            style="yellow",
            markup=False,
        )
    key = "--engine" if engine else "backend.name"
    engine = engine or cfg.backend.name
    spec = backend_spec(engine, res.registry)
    if spec is None and engine != GENERIC_ENGINE and engine not in KNOWN_BACKEND_DISTS:  # a typo is no engine
        from primus.core.config.fields import suggest
        from primus.core.planner.engine_profile import installed_backends

        names = sorted({*res.registry.backends, *installed_backends()})
        hint = suggest(engine, [*names, GENERIC_ENGINE])
        err.print(
            f"error: {key} {engine!r}: no installed backend has that name"
            + (f"; did you mean {hint!r}?" if hint else "")
            + f"; allowed: {', '.join(names) or 'none installed'}, or {GENERIC_ENGINE!r} (core's generic engine)",
            style="red",
            markup=False,
        )
        raise typer.Exit(2)
    try:
        load_profile(spec)  # a broken planner= is reported here, before the search loads it
    except (ImportError, AttributeError, TypeError) as exc:  # the backend's planner= is broken
        err.print(f"error: --engine {engine!r}: its planner profile does not load: {exc}", style="red", markup=False)
        raise typer.Exit(2) from None
    if (spec is None and engine != GENERIC_ENGINE) or (spec is not None and spec.planner is None):  # generic, said
        why = res.registry.missing_backend_message(engine) if spec is None else f"backend {engine!r} gives no profile"
        err.print(
            f"note: {why}; planned as the generic engine (primus.core.planner.engine_profile.GENERIC)",
            style="yellow",
            markup=False,
        )
    try:
        dev = device(device_name, gpu_memory)
    except ValueError as exc:
        err.print(f"error: --device: {exc}", style="red", markup=False)
        raise typer.Exit(2) from None
    cluster = Cluster(dev, nodes, gpus, headroom)
    t = cfg.train
    gbs, mbs = global_batch(res), searched_micro_batches(res)
    k, terms = cfg.kernels, kernel_terms(cfg, res.registry)
    cands = rank(cfg, cluster, engine, res.registry, mbs, gbs)
    if not cands:
        if engine != GENERIC_ENGINE and rank(cfg, cluster, GENERIC_ENGINE, res.registry, mbs, gbs):
            # the cluster divides, the engine runs none of its layouts (a one-process engine on several GPUs)
            err.print(
                f"error: {engine} refuses every layout on {nodes}×{gpus} GPUs: its planner profile offers none at "
                f"world size {nodes * gpus}",
                style="red",
                markup=False,
            )
            raise typer.Exit(4)
        err.print("error: no layout divides this cluster (check --gpus, --nodes and the global batch)", style="red")
        raise typer.Exit(2)
    fitting = [c for c in cands if c.runnable]
    searched = "fixed" if isinstance(mbs, int) else "searched"
    title = (
        f"{cfg.model.name} on {nodes}×{gpus} {dev.name} ({dev.memory_gib:.0f} GiB, {cluster.capacity / GIB:.0f} usable, "
        f"≤ {cluster.budget / GIB:.0f} with {headroom:.0%} headroom), {engine}, seq {t.seq_len}, "
        f"micro-batch {searched}, global batch {gbs or 'auto'}"
    )
    if t.compile:
        title += ", compiled"
    if k.fp8 != "off":
        title += f", FP8 {k.fp8} GEMMs in {terms.fp8_layers} of {cfg.model.num_layers} layers"
    cats = (*CATEGORIES, "fp8") if k.fp8 != "off" else CATEGORIES
    table = Table(title=title, box=None)
    for col in ("#", "layout", "mbs", *cats, "overhead", "total GiB", "step s", "tok/s/GPU", "MFU"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    accepted = [c for c in cands if not c.refused] or cands
    shown = (fitting or sorted(accepted, key=lambda c: c.memory.total))[:top]
    mine = None if own else own_layout(cfg, cands)
    for i, c in enumerate(shown, 1):
        g = c.memory.gib()
        table.add_row(
            str(i),
            c.layout.describe() + (" (the config's)" if c is mine else ""),
            str(c.layout.micro_batch),
            *(f"{g.get(name, 0.0):.1f}" for name in cats),
            f"{sum(g.get(name, 0.0) for name in OVERHEAD):.1f}",
            f"{c.memory.total / GIB:.1f}",
            f"{c.time.total:.2f}",
            f"{c.tokens_per_s_per_device:,.0f}",
            f"{c.mfu:.1%}",
        )
    words = {id(c): merged(added, layout_overrides(cfg, c.layout)) for c in shown}
    report = {
        "config": ref,
        "model": cfg.model.name,
        "engine": engine,
        "cluster": {
            "device": dev.name,
            "memory_gib": dev.memory_gib,
            "nodes": nodes,
            "gpus_per_node": gpus,
            "usable_gib": round(cluster.capacity / GIB, 2),
            "budget_gib": round(cluster.budget / GIB, 2),
            "headroom": headroom,
        },
        "seq_len": t.seq_len,
        "global_batch": gbs,
        "micro_batch": searched,
        "layouts": [_row(i, c, cats, words[id(c)], c is mine) for i, c in enumerate(shown, 1)],
        "recommended": None,
    }
    if not as_json:
        out.print(table)
        if shown:
            out.print("overrides that run each layout (after the config and its words):", highlight=False)
        for i, c in enumerate(shown, 1):
            out.print(f" {i:>2}  {' '.join(words[id(c)]) or '(the config as it is)'}", highlight=False)
    if mine is not None and mine not in shown and not as_json:
        where = f"#{cands.index(mine) + 1} of {len(cands)}" if mine.runnable else "does not fit"
        out.print(f"the config's own layout: {mine.layout.describe()} ({where})", highlight=False)
    refused = [c for c in cands if c.fits and c.refused]
    reasons = Counter(r for c in refused for r in c.refused).most_common(3)
    why = "; ".join(f"{r} ({n}×)" for r, n in reasons)
    if not fitting and refused:
        _json(report, as_json)
        err.print(f"error: {engine} refuses every layout that fits: {why}", style="red", markup=False)
        raise typer.Exit(4)
    if not fitting:
        _json(report, as_json)
        if cands and all(c.refused for c in cands):  # none fits, and the engine would refuse each one anyway
            common = Counter(r for c in cands for r in c.refused).most_common(1)[0][0]
            err.print(
                f"note: {engine} refuses every layout, whatever its memory: {common} (--engine {GENERIC_ENGINE}: core's "
                "estimate without it)",
                style="yellow",
                markup=False,
            )
        best = shown[0]
        err.print(
            f"error: nothing fits: the smallest layout ({best.layout.describe()}, micro-batch {best.layout.micro_batch})"
            f" needs {best.memory.total / GIB:.1f} GiB per GPU, {cluster.capacity / GIB:.1f} GiB usable, "
            f"{cluster.budget / GIB:.1f} with {headroom:.0%} headroom",
            style="red",
            markup=False,
        )
        raise typer.Exit(3)
    if refused:
        err.print(f"note: {len(refused)} layouts that fit are left out, {engine} refuses them: {why}", markup=False)
    best = fitting[0]
    report["recommended"] = report["layouts"][0]
    if _json(report, as_json):
        return
    # the micro-batch where the recommendation changes the config's (the table gives each layout's)
    mb_note = f", micro-batch {best.layout.micro_batch}" if best.layout.micro_batch != t.micro_batch_size else ""
    fp8_note = f", FP8 {k.fp8}" if k.fp8 != "off" else ""
    out.print(f"recommended: {best.layout.describe()}{mb_note}{fp8_note}", highlight=False)  # #1: its words above


def merged(first: list[str], then: list[str]) -> list[str]:
    """``key=value`` words, one per key: the last value given, in the order the keys first come."""
    values = {w.partition("=")[0]: w.partition("=")[2] for w in [*first, *then]}
    return [f"{k}={v}" for k, v in values.items()]


def _row(rank: int, c, cats: tuple[str, ...], words: list[str], own: bool) -> dict:
    """One layout of ``primus plan --json``."""
    from primus.core.planner.memory import GIB

    g = c.memory.gib()
    return {
        "rank": rank,
        "layout": c.layout.describe(),
        "config_own": own,
        "runnable": c.runnable,
        "refused": list(c.refused),
        "micro_batch": c.layout.micro_batch,
        "memory_gib": {name: round(g.get(name, 0.0), 3) for name in (*cats, *OVERHEAD)},
        "total_gib": round(c.memory.total / GIB, 3),
        "step_s": round(c.time.total, 4),
        "tokens_per_s_per_gpu": round(c.tokens_per_s_per_device, 1),
        "mfu": round(c.mfu, 4),
        "overrides": words,
    }


def _json(report: dict, as_json: bool) -> bool:
    if as_json:
        import json

        print(json.dumps(report, indent=1))
    return as_json


def recipe_cluster(ref: str, overrides: list[str]):
    """The ``cluster`` section of the config's layers (:class:`primus.core.config.schema.ClusterConfig`), or None.
    None too when the config does not load or its section is invalid: the full resolve that follows refuses it with
    every error named (and exit 2), where a raise here would escape as a traceback."""
    from pydantic import ValidationError

    from primus.core.config.errors import ConfigError
    from primus.core.config.loader import load_layers
    from primus.core.config.presets import resolver
    from primus.core.config.schema import ClusterConfig
    from primus.core.contracts.plugins import get_registry

    try:
        data = load_layers(ref, overrides, resolver(get_registry())).data.get("cluster")
        return ClusterConfig.model_validate(data) if isinstance(data, dict) else None
    except (ConfigError, ValidationError):
        return None


def own_layout(cfg, cands):
    """The best candidate with the config's own parallel sizes and recompute mode (each candidate is at its fastest
    micro-batch), or None."""
    p = cfg.parallel
    same = [
        c
        for c in cands
        if all(getattr(c.layout, k) == getattr(p, k) for k in ("tp", "pp", "vpp", "cp", "ep"))
        and c.layout.recompute in (p.recompute, "partial" if p.recompute == "full" else p.recompute)
    ]
    # the data-parallel mode is the engine's reading of dp_shard / fsdp: the best one that runs stands for it
    return next((c for c in same if c.runnable), same[0] if same else None)
