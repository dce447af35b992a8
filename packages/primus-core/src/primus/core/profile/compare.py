"""Two runs side by side (``primus analyze --compare RUN_A RUN_B``): the same breakdown for each, and B against A.

Each run is summed over its ranks as the report's headline does: step time and MFU of the slowest rank, time
shares the mean over ranks, kernel categories over all ranks' kernels, per traced step. Differences: time in %
(B / A - 1), shares and MFU in percentage points (B - A).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from primus.core.profile.analyze import RunAnalysis
from primus.core.profile.report import CATEGORIES, COLORS, SHARES, html_table, label, mean_shares, page, swatch


@dataclass
class Row:
    name: str  # a share or category key, or "step time" / "MFU" / "kernel time"
    kind: str  # "time" (ms, difference in %), "share" (difference in points)
    a: float | None
    b: float | None

    def diff(self) -> float | None:
        """B against A: % for a time (None when A is 0), points for a share."""
        if self.a is None or self.b is None:
            return None
        if self.kind == "time":
            return (self.b / self.a - 1) * 100 if self.a else None
        return (self.b - self.a) * 100

    def cells(self) -> tuple[str, str, str]:
        def value(v: float | None) -> str:
            if v is None:
                return "-"
            return f"{v / 1e3:.2f} ms" if self.kind == "time" else f"{v:.1%}"

        d = self.diff()
        unit = "%" if self.kind == "time" else " pts"
        return value(self.a), value(self.b), "-" if d is None else f"{d:+.1f}{unit}"


def summary(run: RunAnalysis) -> dict[str, list[Row]]:
    """One run's side of the comparison, as rows with A filled (B is filled by :func:`compare`)."""
    reports = run.reports
    slowest = max(reports, key=lambda r: r.step_us)
    mean = mean_shares(reports)
    steps = sum(r.steps for r in reports) or 1
    cats = {c: sum(r.categories.get(c, 0) for r in reports) for c in CATEGORIES}
    total = sum(cats.values()) or 1.0
    gemm = cats["gemm"] or 1.0
    return {
        "headline": [
            Row("step time", "time", slowest.step_us, None),
            Row("MFU", "share", slowest.mfu, None),
            Row("kernel time", "time", total / steps, None),
            Row("FP8 share of GEMM time", "share", sum(r.fp8_gemm_us for r in reports) / gemm, None),
        ],
        "shares": [Row(k, "share", mean[k], None) for k in SHARES],
        "category time": [Row(c, "time", cats[c] / steps, None) for c in CATEGORIES],
        "category share": [Row(c, "share", cats[c] / total, None) for c in CATEGORIES],
    }


def compare(a: RunAnalysis, b: RunAnalysis) -> dict[str, list[Row]]:
    """The rows of both runs: A's value, B's value, and B against A."""
    sa, sb = summary(a), summary(b)
    for section, rows in sa.items():
        for row, other in zip(rows, sb[section], strict=True):
            row.b = other.a
    return sa


TITLES = {
    "headline": "Step",
    "shares": "Where the time goes (share of the traced window, mean over ranks)",
    "category time": "Kernel time per step, by category (all ranks)",
    "category share": "Kernel categories (share of summed kernel time)",
}


def _label(run: RunAnalysis, fallback: str) -> str:
    return run.label or fallback


def markdown(a: RunAnalysis, b: RunAnalysis, rows: dict[str, list[Row]] | None = None) -> str:
    rows = rows or compare(a, b)
    la, lb = _label(a, "A"), _label(b, "B")
    lines = [
        "# Comparison",
        "",
        f"- A: {la} — {len(a.reports)} rank(s); {a.engine_line}",
        f"- B: {lb} — {len(b.reports)} rank(s); {b.engine_line}",
        "",
        "Differences are B against A: times in %, shares in points.",
    ]
    for section, title in TITLES.items():
        lines += ["", f"## {title}", "", "| | A | B | B - A |", "|---|---|---|---|"]
        for row in rows[section]:
            lines.append(f"| {LABEL.get(row.name, row.name)} | " + " | ".join(row.cells()) + " |")
    return "\n".join(lines) + "\n"


LABEL = {"gemm": "GEMM"}


def html_page(a: RunAnalysis, b: RunAnalysis, rows: dict[str, list[Row]] | None = None) -> str:
    rows = rows or compare(a, b)
    la, lb = html.escape(_label(a, "A")), html.escape(_label(b, "B"))
    parts = [
        "<h1>Comparison</h1>",
        f'<p class="engine">A: {la} — {len(a.reports)} rank(s); {html.escape(a.engine_line)}<br>'
        f"B: {lb} — {len(b.reports)} rank(s); {html.escape(b.engine_line)}</p>",
        '<p class="note">Differences are B against A: times in %, shares in points.</p>',
    ]
    for section, title in TITLES.items():
        table_rows = []
        for row in rows[section]:
            key = (swatch(row.name) if row.name in COLORS else "") + (
                label(row.name) if row.name in COLORS else html.escape(row.name)
            )
            a_cell, b_cell, d = row.cells()
            color = "" if d == "-" or d.startswith(("+0.0", "-0.0")) else ("#1a7f37" if d[0] == "-" else "#b42318")
            if row.name in ("MFU", "compute") or section == "category share":
                color = ""  # more is not worse here
            style = f' style="color:{color}"' if color else ""
            table_rows.append([key, a_cell, b_cell, f"<b{style}>{d}</b>"])
        parts += [f"<h2>{html.escape(title)}</h2>", html_table(["", "A", "B", "B - A"], table_rows)]
    return page("Comparison", "".join(parts))
