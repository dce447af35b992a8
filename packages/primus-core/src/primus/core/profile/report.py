"""Render a run's analysis (:class:`~primus.core.profile.analyze.RunAnalysis`): a markdown report and a
self-contained HTML page (inline CSS and SVG, no script, no network: it opens anywhere, offline).

The page leads with the headline numbers (step time, MFU, exposed communication, idle), then the run (model,
backend, device, layout, kernels), the time shares per rank, a picture of one step per rank (the time shares
above, each stream's kernels below), the kernel categories, the top kernels and, where HolisticTraceAnalysis
ran, its own numbers. Each meaning has one colour (:data:`COLORS`), the same in every table, bar and picture.
"""

from __future__ import annotations

import html

from primus.core.profile.analyze import RankReport, RunAnalysis

SHARES = ("compute", "exposed communication", "overlapped communication", "idle")
CATEGORIES = (
    "gemm",
    "grouped_gemm",
    "attention",
    "norm",
    "elementwise",
    "routing",
    "communication",
    "all_to_all",
    "optimizer",
    "memory",
    "other",
)
# One colour per meaning, none shared: a time share is never drawn in a kernel category's colour.
COLORS = {
    "compute": "#1b3a6b",  # navy
    "exposed communication": "#e6007e",  # magenta
    "overlapped communication": "#b8b800",  # olive
    "idle": "#d8d8d8",  # light grey
    "gemm": "#4e9de6",  # sky blue
    "attention": "#2ca02c",  # green
    "norm": "#9467bd",  # purple
    "elementwise": "#ff7f0e",  # orange
    "communication": "#d62728",  # red
    "grouped_gemm": "#08306b",  # dark blue (mixture-of-experts' expert GEMMs)
    "routing": "#bcbd22",  # yellow-green (mixture-of-experts' token routing)
    "all_to_all": "#7f0000",  # dark red (expert parallelism's token exchange)
    "optimizer": "#17becf",  # cyan
    "memory": "#8c564b",  # brown
    "other": "#7a7a7a",  # dark grey
}
# shown only where a report has them (a dense model's tables keep their columns)
MOE_CATEGORIES = ("grouped_gemm", "routing", "all_to_all")


def shown_categories(reports: list[RankReport]) -> tuple[str, ...]:
    """:data:`CATEGORIES`, the mixture-of-experts ones only where one of ``reports`` has kernels in them."""
    return tuple(c for c in CATEGORIES if c not in MOE_CATEGORIES or any(r.categories.get(c) for r in reports))


SHARE_COLORS = {k: COLORS[k] for k in SHARES}
CAT_COLORS = {k: COLORS[k] for k in CATEGORIES}
LABELS = {
    "gemm": "GEMM",
    "grouped_gemm": "grouped GEMM",
    "all_to_all": "all-to-all",
    "exposed communication": "exposed comm",
    "overlapped communication": "overlapped comm",
}


def _run(run: RunAnalysis | list[RankReport]) -> RunAnalysis:
    return run if isinstance(run, RunAnalysis) else RunAnalysis(list(run))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _mfu(r: RankReport) -> str:
    return _pct(r.mfu)


def mean_shares(reports: list[RankReport]) -> dict[str, float]:
    n = max(len(reports), 1)
    return {k: sum(r.shares()[k] for r in reports) / n for k in SHARES}


def headline(run: RunAnalysis) -> dict[str, str]:
    """Step time and MFU of the slowest rank (it sets the step), exposed communication and idle over the ranks."""
    if not run.reports:
        return {}
    slowest = max(run.reports, key=lambda r: r.step_us)
    mean = mean_shares(run.reports)
    return {
        "step time": f"{slowest.step_us / 1e3:.1f} ms",
        "MFU": _mfu(slowest),
        "exposed communication": _pct(mean["exposed communication"]),
        "idle": _pct(mean["idle"]),
    }


def config_summary(meta: dict) -> dict[str, str]:
    """What the trace's ``"primus"`` block says about the run ("not recorded" where it says nothing)."""
    none = "not recorded in the trace"
    layout = meta.get("layout") or {}
    kernels = meta.get("kernels") or {}
    return {
        "model": str(meta.get("model") or none),
        "backend": str(meta.get("backend") or none),
        "device": str(meta.get("device_name") or none),
        "layout": " · ".join(f"{k} {v}" for k, v in layout.items()) if layout else none,
        "kernels": ", ".join(f"{k}={v}" for k, v in kernels.items()) if kernels else none,
        "sequence length": str(meta.get("seq_len") or none),
        "FP8": str(meta.get("fp8") or none),
    }


def markdown(run: RunAnalysis | list[RankReport], title: str = "Step time breakdown") -> str:
    run = _run(run)
    reports = run.reports
    head = headline(run)
    lines = [f"# {title}", "", f"Engine: {run.engine_line}", ""]
    if head:
        lines += [" · ".join(f"**{k}** {v}" for k, v in head.items()), ""]
    if run.meta:
        lines += ["## Run", "", "| " + " | ".join(config_summary(run.meta)) + " |", "|---" * 7 + "|"]
        lines += ["| " + " | ".join(config_summary(run.meta).values()) + " |", ""]
    lines += [
        "## Where the time goes (share of the traced window)",
        "",
        "| rank | steps | step ms | compute | exposed comm | overlapped comm | idle | MFU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        s = r.shares()
        lines.append(
            f"| {r.rank} | {r.steps} | {r.step_us / 1e3:.1f} | {s['compute']:.1%} | {s['exposed communication']:.1%} "
            f"| {s['overlapped communication']:.1%} | {s['idle']:.1%} | {_mfu(r)} |"
        )
    if len(reports) > 1:  # the ranks together: the slowest sets the step
        n = len(reports)
        mean = mean_shares(reports)
        slowest = max(reports, key=lambda r: r.step_us)
        lines.append(
            f"| mean of {n} | | {slowest.step_us / 1e3:.1f} (max) | {mean['compute']:.1%} "
            f"| {mean['exposed communication']:.1%} | {mean['overlapped communication']:.1%} | {mean['idle']:.1%} "
            f"| {_mfu(slowest)} |"
        )
    cats = shown_categories(reports)
    lines += [
        "",
        "## Kernel categories (share of summed kernel time; each kernel in one category)",
        "",
        "| rank | " + " | ".join(cats) + " | kernel ms |",
        "|---" * (len(cats) + 2) + "|",
    ]
    for r in reports:
        total = sum(r.categories.values()) or 1.0
        lines.append(
            f"| {r.rank} | "
            + " | ".join(f"{r.categories.get(c, 0) / total:.1%}" for c in cats)
            + f" | {total / 1e3:.1f} |"
        )
    if any(r.fp8_gemm_us for r in reports):
        shares = ", ".join(f"rank {r.rank} {r.fp8_gemm_us / (r.categories.get('gemm') or 1.0):.1%}" for r in reports)
        lines += ["", f"FP8 GEMMs (FP8 operands, by kernel name), share of GEMM time: {shares}"]
    for r in reports[:1]:
        lines += [
            "",
            f"## Top kernels (rank {r.rank})",
            "",
            "| kernel | category | total ms | calls |",
            "|---|---|---|---|",
        ]
        lines += [f"| `{n[:100]}` | {r.top_categories.get(n, '')} | {t / 1e3:.2f} | {c} |" for n, t, c in r.top]
    if run.engine == "hta":
        lines += hta_markdown(run)
    return "\n".join(lines) + "\n"


def hta_markdown(run: RunAnalysis) -> list[str]:
    lines = [
        "",
        "## HolisticTraceAnalysis, in its own terms",
        "",
        "Temporal breakdown (HTA's compute leaves out memcpy / memset, which primus counts as compute) and the share "
        "of communication time overlapped by computation; CUDA launches where the trace has the CPU side.",
        "",
        "| rank | compute | non-compute | idle | comm-comp overlap | launches | launch delay median / p95 us "
        "| kernels shorter than their launch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in run.reports:
        h, ln = r.hta or {}, r.launch
        launch = (
            f"{ln['launches']:.0f} | {ln['launch_delay_median_us']:.1f} / {ln['launch_delay_p95_us']:.1f} "
            f"| {ln['gpu_shorter_than_launch']:.1%}"
            if ln
            else "not in the trace | - | -"
        )
        lines.append(
            f"| {r.rank} | {_pct(h.get('compute'))} | {_pct(h.get('non-compute'))} | {_pct(h.get('idle'))} "
            f"| {_pct(h.get('comm-comp overlap'))} | {launch} |"
        )
    if run.kernel_types:
        split = ", ".join(f"{k} {v:.1f}%" for k, v in run.kernel_types.items())
        lines += ["", f"HTA kernel types, all ranks (HTA truncates each interval to whole us): {split}"]
    return lines


# ---- HTML ----

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:24px;color:#222;max-width:1240px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.engine{color:#555;font-size:13px;margin:0 0 16px}
.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{border:1px solid #ddd;border-radius:6px;padding:10px 16px;min-width:150px;background:#fafafa}
.card .v{font-size:26px;font-weight:600}.card .k{font-size:12px;color:#666;text-transform:uppercase}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:right}th{background:#f2f2f2}
td.l,th.l{text-align:left}td.k{font-family:ui-monospace,Menlo,monospace;font-size:12px;text-align:left;
max-width:640px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.sw{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:-2px;margin-right:5px}
.legend span.i{margin-right:14px;font-size:13px;white-space:nowrap}
.note{color:#555;font-size:13px}
"""


def swatch(key: str) -> str:
    return f'<span class="sw" style="background:{COLORS[key]}"></span>'


def label(key: str) -> str:
    return html.escape(LABELS.get(key, key))


def _legend(keys) -> str:
    return '<p class="legend">' + "".join(f'<span class="i">{swatch(k)}{label(k)}</span>' for k in keys) + "</p>"


def _stacked(parts: list[tuple[str, float]], width: int = 560, height: int = 16) -> str:
    """One horizontal bar, inline SVG: each part its meaning's colour, ``frac`` of the width."""
    out, x = [], 0.0
    for key, frac in parts:
        w = max(frac, 0) * width
        if w > 0:
            out.append(
                f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" fill="{COLORS[key]}">'
                f"<title>{label(key)} {frac:.1%}</title></rect>"
            )
        x += w
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">{"".join(out)}</svg>'


def html_table(head: list[str], rows: list[list[str]], left: int = 1, classes: dict[int, str] | None = None) -> str:
    """An HTML table: the first ``left`` columns left-aligned, ``classes`` a column's own class (e.g. "k")."""

    def cls(i: int) -> str:
        return (classes or {}).get(i) or ("l" if i < left else "")

    th = "".join(f'<th class="{"l" if i < left else ""}">{h}</th>' for i, h in enumerate(head))
    thead = f"<thead><tr>{th}</tr></thead>" if any(head) else ""
    body = "".join(
        "<tr>" + "".join(f'<td class="{cls(i)}">{c}</td>' for i, c in enumerate(row)) + "</tr>" for row in rows
    )
    return f"<table>{thead}<tbody>{body}</tbody></table>"


def timeline_svg(reports: list[RankReport], width: int = 1180) -> str:
    """One step per rank: a "busy" lane (compute / exposed / overlapped communication; blank is idle) over one lane
    per stream (kernels in their category's colour). Time runs left to right from the step's start."""
    label_w, lane_h, gap = 120, 20, 4
    plot_w = width - label_w - 10
    out, y = [], 0
    for r in reports:
        lanes = list(dict.fromkeys(lane for lane, *_ in r.timeline))
        if not lanes:
            continue
        span = r.timeline_us or 1.0
        out.append(
            f'<text x="0" y="{y + 12}" font-size="13" font-weight="600">rank {html.escape(r.rank)} · one step, '
            f"{span / 1e3:.1f} ms</text>"
        )
        y += 18
        top = y
        for lane in lanes:
            name = "time shares" if lane == "busy" else lane
            out.append(f'<text x="0" y="{y + lane_h - 6}" font-size="11" fill="#444">{html.escape(name)}</text>')
            # blank time: idle on the time-share lane (nothing runs), a stream's gaps elsewhere
            back = COLORS["idle"] if lane == "busy" else "#f4f4f4"
            out.append(f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{lane_h}" fill="{back}"/>')
            for lane_name, s, e, what in r.timeline:
                if lane_name != lane:
                    continue
                x0 = label_w + s / span * plot_w
                w = max((e - s) / span * plot_w, 0.6)
                out.append(
                    f'<rect x="{x0:.2f}" y="{y}" width="{w:.2f}" height="{lane_h}" fill="{COLORS[what]}">'
                    f"<title>{label(what)} {(e - s) / 1e3:.3f} ms at {s / 1e3:.3f} ms</title></rect>"
                )
            y += lane_h + gap
        for i in range(5):  # time axis: 0, 1/4, 1/2, 3/4, the step
            x = label_w + i / 4 * plot_w
            out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{y}" stroke="#999" stroke-width="0.5"/>')
            anchor = "start" if i == 0 else "end" if i == 4 else "middle"
            out.append(
                f'<text x="{x:.1f}" y="{y + 11}" font-size="10" fill="#666" text-anchor="{anchor}">'
                f"{span * i / 4 / 1e3:.1f} ms</text>"
            )
        y += 24
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" role="img">{"".join(out)}</svg>'


def html_page(
    run: RunAnalysis | list[RankReport], title: str = "Step time breakdown", notes: list[str] | None = None
) -> str:
    run = _run(run)
    reports = run.reports
    parts = [f"<h1>{html.escape(title)}</h1>", f'<p class="engine">{html.escape(run.engine_line)}</p>']
    head = headline(run)
    if head:
        parts.append(
            '<div class="cards">'
            + "".join(
                f'<div class="card"><div class="k">{html.escape(k)}</div><div class="v">{html.escape(v)}</div></div>'
                for k, v in head.items()
            )
            + "</div>"
        )
        if len(reports) > 1:
            parts.append('<p class="note">Step time and MFU: the slowest rank; communication and idle: the mean.</p>')
    parts += [f'<p class="note">{html.escape(n)}</p>' for n in notes or []]
    if run.meta:
        summary = config_summary(run.meta)
        parts += [
            "<h2>Run</h2>",
            html_table(["", ""], [[html.escape(k), html.escape(v)] for k, v in summary.items()], 2),
        ]
    # time shares
    rows = []
    for r in reports:
        s = r.shares()
        rows.append(
            [html.escape(r.rank), str(r.steps), f"{r.step_us / 1e3:.1f}"]
            + [_pct(s[k]) for k in SHARES]
            + [_mfu(r), _stacked([(k, s[k]) for k in SHARES], 300)]
        )
    if len(reports) > 1:
        mean = mean_shares(reports)
        slowest = max(reports, key=lambda r: r.step_us)
        rows.append(
            [f"mean of {len(reports)}", "", f"{slowest.step_us / 1e3:.1f} (max)"]
            + [_pct(mean[k]) for k in SHARES]
            + [_mfu(slowest), _stacked([(k, mean[k]) for k in SHARES], 300)]
        )
    parts += [
        "<h2>Where the time goes</h2>",
        '<p class="note">Shares of the traced window, from the first to the last kernel; nothing is counted twice.</p>',
        html_table(["rank", "steps", "step ms", *(swatch(k) + label(k) for k in SHARES), "MFU", "share"], rows),
    ]
    # one step
    if any(r.timeline for r in reports):
        present = {what for r in reports for _, _, _, what in r.timeline}
        parts += [
            "<h2>One step</h2>",
            _legend([k for k in (*SHARES[:3], "idle", *CATEGORIES) if k in present or k == "idle"]),
            timeline_svg(reports),
        ]
    # kernel categories
    rows, cats = [], shown_categories(reports)
    for r in reports:
        total = sum(r.categories.values()) or 1.0
        rows.append(
            [html.escape(r.rank)]
            + [_pct(r.categories.get(c, 0) / total) for c in cats]
            + [f"{total / 1e3:.1f}", _stacked([(c, r.categories.get(c, 0) / total) for c in cats], 300)]
        )
    parts += [
        "<h2>Kernel categories</h2>",
        '<p class="note">Share of summed kernel time; each kernel in one category, by name.</p>',
        html_table(["rank", *(swatch(c) + label(c) for c in cats), "kernel ms", "share"], rows),
    ]
    if any(r.fp8_gemm_us for r in reports):
        fp8 = ", ".join(f"rank {r.rank} {r.fp8_gemm_us / (r.categories.get('gemm') or 1.0):.1%}" for r in reports)
        parts.append(f'<p class="note">FP8 GEMMs (FP8 operands, by kernel name), share of GEMM time: {fp8}</p>')
    for r in reports[:1]:
        rows = [
            [
                f'<span title="{html.escape(n)}">{html.escape(n[:110])}</span>',
                swatch(r.top_categories.get(n, "other")) + label(r.top_categories.get(n, "other")),
                f"{t / 1e3:.2f}",
                str(c),
                f"{t / c:.1f}",
            ]
            for n, t, c in r.top
        ]
        table = html_table(["kernel", "category", "total ms", "calls", "mean us"], rows, 2, {0: "k"})
        parts += [f"<h2>Top kernels (rank {html.escape(r.rank)})</h2>", table]
    if run.engine == "hta":
        rows = []
        for r in reports:
            h, ln = r.hta or {}, r.launch
            rows.append(
                [html.escape(r.rank)]
                + [_pct(h.get(k)) for k in ("compute", "non-compute", "idle", "comm-comp overlap")]
                + (
                    [
                        f"{ln['launches']:.0f}",
                        f"{ln['launch_delay_median_us']:.1f} / {ln['launch_delay_p95_us']:.1f}",
                        _pct(ln["gpu_shorter_than_launch"]),
                    ]
                    if ln
                    else ["not in the trace", "-", "-"]
                )
            )
        parts += [
            "<h2>HolisticTraceAnalysis, in its own terms</h2>",
            '<p class="note">Temporal breakdown (HTA\'s compute leaves out memcpy / memset, which primus counts as '
            "compute), the share of communication time overlapped by computation, and CUDA launch statistics where "
            "the trace has the CPU side.</p>",
            html_table(
                [
                    "rank",
                    "compute",
                    "non-compute",
                    "idle",
                    "comm-comp overlap",
                    "launches",
                    "launch delay median / p95 us",
                    "kernels shorter than their launch",
                ],
                rows,
            ),
        ]
        if run.kernel_types:
            split = ", ".join(f"{html.escape(k)} {v:.1f}%" for k, v in run.kernel_types.items())
            parts.append(f'<p class="note">HTA kernel types, all ranks: {split}</p>')
    return page(title, "".join(parts))


def page(title: str, body: str) -> str:
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style></head><body>{body}</body></html>\n"
    )
