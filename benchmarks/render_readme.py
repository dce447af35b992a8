"""The README's GPU speed table, rendered from the GPU suite's last committed result.

    python3 benchmarks/render_readme.py            # rewrite the block in README.md
    python3 benchmarks/render_readme.py --check    # exit 1 when README.md's block differs (tests/ run this)

The block sits between ``<!-- gpu-suite:begin -->`` and ``<!-- gpu-suite:end -->``. Its numbers come only from
``benchmarks/results/gpu_suite.json`` (``gpu_suite.py --out``); with no such file it says "not measured".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
RESULT = HERE / "results" / "gpu_suite.json"
README = HERE.parent / "README.md"
BEGIN, END = "<!-- gpu-suite:begin -->", "<!-- gpu-suite:end -->"


def _num(v: float | None, spec: str) -> str:
    return "not measured" if v is None else format(v, spec)


def _planner_speed(result: dict) -> list[dict]:
    """The planner's tokens/s for each row it is held to (docs/generate.py's ``planner_speed``: the row's own command,
    planned on the result's GPU), with its error against the measured."""
    sys.path.insert(0, str(HERE.parent / "docs"))
    from generate import SPEED_ROWS, planner_speed

    measured = {r["row"] for r in result["rows"]}
    return planner_speed(result) if set(SPEED_ROWS) <= measured else []


def render(result: dict | None) -> str:
    """The block's text (markers excluded) for a suite result, or for none."""
    if result is None:
        return "Not measured: the GPU suite (`benchmarks/gpu_suite.py`) has no committed result yet.\n"
    rows = result["rows"]
    ok = sum(r["status"] == "passed" for r in rows)
    speed = {p["row"]: p for p in _planner_speed(result)}
    lines = [
        f"From `benchmarks/results/gpu_suite.json` ({result['date']}, {result['gpu']}, torch {result['torch']}; "
        f"{ok} of {len(rows)} rows passed; `{result['command']}`):",
        "",
        "| run | status | tokens/s per GPU | planner tokens/s | MFU | ratio | against | peak / planner GiB "
        "| to first step s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("tokens_per_s") is None and r.get("ratio") is None and r.get("first_step_s") is None:
            continue
        mem = ""
        if r.get("peak_gib") is not None:
            mem = f"{r['peak_gib']:.1f}" + (f" / {r['predicted_gib']:.1f}" if r.get("predicted_gib") else "")
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
        p = speed.get(r["row"])
        planned = "" if p is None else f"{p['predicted']:,.0f} ({p['error']:+.1%})"
        lines.append(
            f"| {r['row']} | {r['status']} | {_num(r.get('tokens_per_s'), ',.0f') if 'tokens_per_s' in r else ''} "
            f"| {planned} | {'' if r.get('mfu') is None else format(r['mfu'], '.1%')} | {ratio} | {r.get('vs') or ''} | {mem} "
            f"| {'' if r.get('first_step_s') is None else format(r['first_step_s'], '.1f')} |"
        )
    return "\n".join(lines) + "\n"


def block(readme: str) -> str:
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[start:end].strip("\n") + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    result = json.loads(RESULT.read_text()) if RESULT.exists() else None
    text, readme = render(result), README.read_text()
    if args.check:
        if block(readme) != text:
            print(
                "README.md's GPU table differs from benchmarks/results/gpu_suite.json: run benchmarks/render_readme.py"
            )
            return 1
        return 0
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    README.write_text(readme[:start] + "\n" + text + readme[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
