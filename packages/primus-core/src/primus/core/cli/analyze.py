"""``primus analyze TRACE...``: the step-time report of existing Chrome traces (one per rank), or with
``--compare RUN_A RUN_B`` two runs side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def analyze(
    traces: Annotated[
        list[Path],
        typer.Argument(
            help="Chrome trace JSON files (.json or .json.gz), one per rank, or a folder of them (a run's output "
            "folder, its traces/ or profile/ folder); with --compare, two runs"
        ),
    ],
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="write report.md and report.html (compare.md / .html) here")
    ] = None,
    compare: Annotated[
        bool,
        typer.Option("--compare", help="two runs side by side, B against A: shares in points, times in %"),
    ] = False,
    engine: Annotated[
        str,
        typer.Option(
            help="auto: HolisticTraceAnalysis where it can read the traces, else primus's own parser; "
            "hta: HolisticTraceAnalysis or an error; primus: primus's own parser"
        ),
    ] = "auto",
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

    from primus.core.cli.helpers import err, out
    from primus.core.profile import hta_engine
    from primus.core.profile.analyze import ENGINES, analyze_run, find_traces

    if engine not in ENGINES:
        err.print(f"error: --engine must be one of {', '.join(ENGINES)}", style="red", markup=False)
        raise typer.Exit(2)
    if compare and len(traces) != 2:
        err.print("error: --compare takes two runs (RUN_A RUN_B)", style="red", markup=False)
        raise typer.Exit(2)
    missing = [str(p) for p in traces if not p.exists()]
    if missing:
        err.print(f"error: no such trace: {', '.join(missing)}", style="red", markup=False)
        raise typer.Exit(2)
    peak = peak_tflops * 1e12 if peak_tflops else None
    runs = [[p] for p in traces] if compare else [traces]
    analyses = []
    for run in runs:
        try:
            paths = [t for p in run for t in find_traces(p)]
            analyses.append(analyze_run(paths, top, flops_per_step, peak, engine, label=", ".join(map(str, run))))
        except FileNotFoundError as exc:
            err.print(f"error: {exc}", style="red", markup=False)
            raise typer.Exit(2) from None
        except hta_engine.Unavailable as exc:
            err.print(f"error: {exc}", style="red", markup=False)
            raise typer.Exit(2) from None
        except (ValueError, KeyError) as exc:
            err.print(f"error: not a Chrome trace ({type(exc).__name__}: {exc})", style="red", markup=False)
            raise typer.Exit(2) from None
    if compare:
        from primus.core.profile import compare as cmp

        rows = cmp.compare(*analyses)
        text, page, names = (
            cmp.markdown(*analyses, rows),
            cmp.html_page(*analyses, rows),
            ("compare.md", "compare.html"),
        )
    else:
        from primus.core.profile.report import html_page, markdown

        text, page, names = markdown(analyses[0]), html_page(analyses[0]), ("report.md", "report.html")
    out.print(Markdown(text))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / names[0]).write_text(text)
        (out_dir / names[1]).write_text(page)
        out.print(f"wrote {out_dir / names[0]} and {out_dir / names[1]}", highlight=False)
