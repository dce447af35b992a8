"""Two GPU-suite results side by side: each row's tokens/s (or time to the first step) in both, and new / old.

    python3 benchmarks/compare_suites.py OLD.json NEW.json [--out FILE.md]

Made for an engine upgrade (issue 53: megatron-core 0.16.1 -> 0.19.2): the rows of the engine that did not change are
the control, so a row's change beyond theirs is the upgrade's, not the machine's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _value(row: dict) -> tuple[str, float] | None:
    if row.get("tokens_per_s"):
        return "tokens/s", row["tokens_per_s"]
    if row.get("first_step_s"):
        return "s to step 1", row["first_step_s"]
    return None


def compare(old: dict, new: dict) -> str:
    before = {r["row"]: r for r in old["rows"]}
    lines = [
        f"| row | unit | {old.get('megatron-core', '?')} / {old.get('torchtitan', '?')} | "
        f"{new.get('megatron-core', '?')} / {new.get('torchtitan', '?')} | new / old |",
        "|---|---|---|---|---|",
    ]
    for r in new["rows"]:
        b, a = _value(before.get(r["row"], {})), _value(r)
        if a is None or b is None:
            continue
        lines.append(f"| {r['row']} | {a[0]} | {b[1]:,.1f} | {a[1]:,.1f} | {a[1] / b[1]:.3f} |")
    head = (
        f"Old: {old['date']}, {old['gpu']}, megatron-core {old.get('megatron-core')}, torchtitan "
        f"{old.get('torchtitan')}.  New: {new['date']}, {new['gpu']}, megatron-core {new.get('megatron-core')}, "
        f"torchtitan {new.get('torchtitan')}. Columns are megatron-core / torchtitan versions."
    )
    return head + "\n\n" + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    text = compare(json.loads(args.old.read_text()), json.loads(args.new.read_text()))
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
