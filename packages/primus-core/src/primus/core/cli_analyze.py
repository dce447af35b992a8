"""``primus analyze TRACE...``: the step-time report of existing Chrome traces (one per rank)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def analyze(
    traces: Annotated[list[Path], typer.Argument(help="Chrome trace JSON files (.json or .json.gz), one per rank")],
    out_dir: Annotated[Path | None, typer.Option("--out", help="write report.md and report.html here")] = None,
    top: Annotated[int, typer.Option(help="top kernels listed")] = 10,
    flops_per_step: Annotated[
        float | None,
        typer.Option(help="model FLOPs of one step on one device (default: the trace's own primus block)"),
    ] = None,
    peak_tflops: Annotated[
        float | None, typer.Option(help="the device's dense bf16 peak, TFLOP/s (default: the trace's)")
    ] = None,
) -> None:
    """Compute / exposed and overlapped communication / idle, step time and MFU, kernel categories, top kernels."""
    from rich.markdown import Markdown

    from primus.core.cli_helpers import err, out
    from primus.core.profile.analyze import analyze_files
    from primus.core.profile.report import html_page, markdown

    missing = [str(p) for p in traces if not p.is_file()]
    if missing:
        err.print(f"error: no such trace: {', '.join(missing)}", style="red", markup=False)
        raise typer.Exit(2)
    try:
        reports = analyze_files(traces, top, flops_per_step, peak_tflops * 1e12 if peak_tflops else None)
    except (ValueError, KeyError) as exc:
        err.print(f"error: not a Chrome trace ({type(exc).__name__}: {exc})", style="red", markup=False)
        raise typer.Exit(2) from None
    text = markdown(reports)
    out.print(Markdown(text))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "report.md").write_text(text)
        (out_dir / "report.html").write_text(html_page(reports))
        out.print(f"wrote {out_dir / 'report.md'} and {out_dir / 'report.html'}", highlight=False)
