"""``primus profile CONFIG``: train a few steps under torch.profiler, then write the step-time report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def profile(
    config: Annotated[str, typer.Argument(help="a YAML file or a preset name")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides")] = None,
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", help="processes (devices) per node")] = 1,
    master_port: Annotated[int, typer.Option(help="rendezvous port")] = 29500,
) -> None:
    """Runs ``primus train`` with profiling on (checkpoints off), then analyzes the traces it wrote."""
    from primus.core.cli.helpers import err, out, resolve_or_exit
    from primus.core.profile.analyze import analyze_run
    from primus.core.profile.capture import trace_dir
    from primus.core.profile.report import html_page, markdown
    from primus.core.run.rundir import output_dir

    res = resolve_or_exit(config, overrides, nproc_per_node, check_plugins=False)
    p = res.config.profile
    # a few steps, not the recipe's run: the profiler's schedule and one more. train.steps=N on the command line
    # gives more; fewer would end before the traced steps (an empty trace), so the schedule's count is taken then.
    needed = p.wait + p.warmup + p.active + 1
    given = {o.split("=")[0] for o in overrides or []}
    steps = max(res.config.train.steps, needed) if "train.steps" in given else needed
    if "train.steps" in given and res.config.train.steps < needed:
        err.print(
            f"note: train.steps={res.config.train.steps} ends before the traced steps "
            f"(profile.wait + warmup + active + 1 = {needed}): running {needed}",
            markup=False,
        )
    extra = ["profile.enabled=true", "checkpoint.enabled=false"]
    extra.append(f"train.schedule.warmup_steps={min(res.config.train.schedule.warmup_steps, steps)}")
    extra = [e for e in extra if e.split("=")[0] not in given] + [f"train.steps={steps}"]
    res = resolve_or_exit(config, [*(overrides or []), *extra], nproc_per_node)
    out_dir = output_dir(res.config)
    from primus.core.cli.train import train

    try:
        train(config, [*(overrides or []), *extra], nproc_per_node=nproc_per_node, master_port=master_port)
    except typer.Exit as exc:
        if exc.exit_code:
            raise
    traces = sorted(trace_dir(out_dir).glob("rank*.json"))
    if not traces:
        err.print(f"error: the backend wrote no trace under {trace_dir(out_dir)}", style="red", markup=False)
        raise typer.Exit(1)
    run = analyze_run(traces)  # HolisticTraceAnalysis where it can read them (GPU traces), else primus's parser
    title = f"Step time breakdown: {res.config.model.name} on {res.config.backend.name}"
    text = markdown(run, title)
    metrics = out_dir / "metrics.jsonl"
    notes = []
    if metrics.is_file():
        last = json.loads(metrics.read_text().splitlines()[-1])
        if "mfu" in last:
            notes.append(f"MFU (last logged interval): {last['mfu']:.1%}")
        if "tflops_per_device" in last:
            notes.append(f"TFLOP/s per device: {last['tflops_per_device']:.1f}")
    if notes:
        text += "\n" + "\n".join(notes) + "\n"
    report_dir = Path(out_dir) / "profile"
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "report.md").write_text(text)
    (report_dir / "report.html").write_text(html_page(run, title, notes))
    from rich.markdown import Markdown

    out.print(Markdown(text))
    out.print(f"wrote {report_dir / 'report.md'} and {report_dir / 'report.html'}", highlight=False)
