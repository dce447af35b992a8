"""Render :class:`RankReport` s: a markdown report (tables as in the seed's Tables 1 and 2) and a
self-contained HTML page with stacked bars (inline SVG, no scripts, opens anywhere)."""

from __future__ import annotations

import html

from primus.core.profile.analyze import RankReport

SHARE_COLORS = {
    "compute": "#3b7dd8",
    "exposed communication": "#d9534f",
    "overlapped communication": "#f0ad4e",
    "idle": "#cccccc",
}
CAT_COLORS = {
    "gemm": "#3b7dd8",
    "attention": "#5cb85c",
    "norm": "#9b59b6",
    "elementwise": "#f0ad4e",
    "communication": "#d9534f",
    "optimizer": "#1abc9c",
    "memory": "#95a5a6",
    "other": "#cccccc",
}


def _mfu(r: RankReport) -> str:
    return "-" if r.mfu is None else f"{r.mfu:.1%}"


def markdown(reports: list[RankReport], title: str = "Step time breakdown") -> str:
    lines = [
        f"# {title}",
        "",
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
        mean = {k: sum(r.shares()[k] for r in reports) / n for k in SHARE_COLORS}
        slowest = max(reports, key=lambda r: r.step_us)
        lines.append(
            f"| mean of {n} | | {slowest.step_us / 1e3:.1f} (max) | {mean['compute']:.1%} "
            f"| {mean['exposed communication']:.1%} | {mean['overlapped communication']:.1%} | {mean['idle']:.1%} "
            f"| {_mfu(slowest)} |"
        )
    lines += [
        "",
        "## Kernel categories (share of summed kernel time; each kernel in one category)",
        "",
        "| rank | " + " | ".join(CAT_COLORS) + " | kernel ms |",
        "|---" * (len(CAT_COLORS) + 2) + "|",
    ]
    for r in reports:
        total = sum(r.categories.values()) or 1.0
        lines.append(
            f"| {r.rank} | "
            + " | ".join(f"{r.categories.get(c, 0) / total:.1%}" for c in CAT_COLORS)
            + f" | {total / 1e3:.1f} |"
        )
    if any(r.fp8_gemm_us for r in reports):
        shares = ", ".join(f"rank {r.rank} {r.fp8_gemm_us / (r.categories.get('gemm') or 1.0):.1%}" for r in reports)
        lines += ["", f"FP8 GEMMs (FP8 operands, by kernel name), share of GEMM time: {shares}"]
    for r in reports[:1]:
        lines += ["", f"## Top kernels (rank {r.rank})", "", "| kernel | total ms | calls |", "|---|---|---|"]
        lines += [f"| `{n[:100]}` | {t / 1e3:.2f} | {c} |" for n, t, c in r.top]
    return "\n".join(lines) + "\n"


def _bar(y: int, label: str, parts: list[tuple[str, float, str]], width: int = 600) -> str:
    out = [f'<text x="0" y="{y + 14}" font-size="12">{html.escape(label)}</text>']
    x = 120.0
    for name, frac, color in parts:
        w = max(frac, 0) * width
        if w > 0:
            out.append(
                f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="18" fill="{color}">'
                f"<title>{html.escape(name)} {frac:.1%}</title></rect>"
            )
        x += w
    return "".join(out)


def html_page(reports: list[RankReport], title: str = "Step time breakdown") -> str:
    rows, y = [], 0
    for r in reports:
        rows.append(_bar(y, f"rank {r.rank} time", [(k, v, SHARE_COLORS[k]) for k, v in r.shares().items()]))
        total = sum(r.categories.values()) or 1.0
        rows.append(
            _bar(
                y + 22,
                f"rank {r.rank} kernels",
                [(c, r.categories.get(c, 0) / total, CAT_COLORS[c]) for c in CAT_COLORS],
            )
        )
        y += 54
    legend = "".join(
        f'<span style="background:{c};padding:0 8px;margin-right:4px"></span>{html.escape(k)} &nbsp;'
        for k, c in {**SHARE_COLORS, **CAT_COLORS}.items()
    )
    svg = f'<svg xmlns="http://www.w3.org/2000/svg" width="740" height="{y + 10}">{"".join(rows)}</svg>'
    body = markdown(reports, title).replace("&", "&amp;").replace("<", "&lt;")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body style='font-family:sans-serif'><h1>{html.escape(title)}</h1><p>{legend}</p>{svg}"
        f"<pre>{body}</pre></body></html>"
    )
