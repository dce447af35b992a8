"""Where a Primus run's start-up goes, function by function: cProfile around one rank's run (in this process, so the
profile is written; ``primus train`` itself leaves through ``os._exit``), its heaviest calls by cumulative and own
time into a JSON.

    python3 benchmarks/startup_profile.py --out DIR [--engines megatron,torchtitan] [--init canonical] [WORDS...]

Default run: Llama 3.2 1B, seq 4096, micro-batch 2, one step of random tokens, bf16, on one GPU (the start-up
benchmark's, ``startup.py``); ``WORDS`` are more overrides. Written: ``DIR/<engine>_<init>.json`` with the run's
start-up record (core's) and the top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _common import run_overrides, versions  # noqa: E402

TOP = 40


def top(stats: pstats.Stats, key: str) -> list[dict]:
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:TOP]:  # (file, line, name), in the sort order
        cc, nc, tt, ct, _ = stats.stats[func]
        rows.append({"function": f"{func[0]}:{func[1]}({func[2]})", "calls": nc, "own_s": round(tt, 3),
                     "cum_s": round(ct, 3)})  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--engines", default="megatron,torchtitan")
    ap.add_argument("--init", default="canonical", choices=("canonical", "engine"))
    ap.add_argument("--preset", default="llama3.2-1b")
    ap.add_argument("words", nargs="*")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from primus.core.launch.rank import run_rank
    from primus.core.launch.resolve import resolve

    for engine in args.engines.split(","):
        run = out / f"run_{engine}"
        words = [
            *run_overrides(run, 4096, 2, 1),
            "train.precision=bf16",
            f"train.init={args.init}",
            f"backend.name={engine}",
            *args.words,
        ]
        prof = cProfile.Profile()
        prof.enable()
        summary = run_rank(resolve(args.preset, words, world_size=1))
        prof.disable()
        stats = pstats.Stats(prof)
        result = {
            **versions(),
            "command": f"primus train {args.preset} " + " ".join(words),
            "startup": summary.get("startup"),
            "by_cumulative": top(stats, "cumulative"),
            "by_own": top(stats, "tottime"),
        }
        (out / f"{engine}_{args.init}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(engine, args.init, summary.get("startup"), flush=True)
        for row in result["by_own"][:15]:
            print(f"  {row['own_s']:8.3f} {row['cum_s']:8.3f} {row['calls']:>8} {row['function'][-110:]}", flush=True)
        from _common import release

        release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
