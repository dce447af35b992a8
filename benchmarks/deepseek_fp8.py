"""FP8 and multi-token prediction on a DeepSeek-V3-architecture model (multi-head latent attention, sigmoid router, shared experts): the GPU
suite's deepseek runs (4 blocks of Moonlight-16B-A3B, seq 4096, turbo) in bf16, with ``kernels.fp8=rowwise`` as a user
leaves it (core's rule: eager, the linears of at least 4096 x 4096; experts bf16 where FP8 grouped GEMMs are not
measured faster) and with every linear forced into FP8 (``fp8_recipe.linears: all``: MLA's projections too), on
each engine: tokens/s, the ratio to bf16 and the losses' mean relative gap. ``--cases bf16,mtp --engines megatron``:
one multi-token-prediction depth (``model.mtp.layers=1``, megatron only) against bf16 without.

    python3 benchmarks/deepseek_fp8.py --out DIR            # on one H100 / H200, ~4 minutes
    python3 benchmarks/deepseek_fp8.py --out DIR --smoke    # tiny-deepseek on CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import gpu_suite  # noqa: E402
from _common import run_overrides  # noqa: E402

CASES = {
    "bf16": [],
    "fp8_auto": ["kernels.fp8=rowwise"],
    "fp8_all": ["kernels.fp8=rowwise", "kernels.fp8_recipe.linears=all"],
    "mtp": ["model.mtp.layers=1"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--engines", default=",".join(gpu_suite.ENGINES), help="comma list")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)} (the first: the base)")
    ap.add_argument("--repeat", type=int, default=1, help="each case this many times, interleaved")
    args = ap.parse_args()
    suite = gpu_suite.Suite(argparse.Namespace(out=args.out, work=None, smoke=args.smoke))
    preset = "tiny-deepseek" if args.smoke else "moonlight-16b-a3b"
    seq, micro, steps = (64, 2, 3) if args.smoke else (4096, 1, 12)
    common = [*run_overrides("", seq, micro, steps)[:-1], "train.precision=bf16"]
    common += [] if args.smoke else ["model.num_layers=4"]
    rows = []
    for engine in args.engines.split(","):
        for i in range(args.repeat):
            base = None
            for case in args.cases.split(","):
                name = f"deepseek_fp8/{engine}/{case}" + (f"/{i + 1}" if args.repeat > 1 else "")
                row = suite.train(name, preset, [*common, f"backend.name={engine}", *CASES[case]], warmup=4)
                if base is None:
                    base = row
                else:
                    gpu_suite.speed_pair(row, base, 0.0, "")
                    gpu_suite.fp8_loss_check(row, base)
                rows.append(row)
    suite.rows.extend(rows)
    suite.save()  # DIR/gpu_suite.json and .md: the suite's format
    print(
        json.dumps(
            [
                {k: r.get(k) for k in ("row", "status", "tokens_per_s", "ratio", "loss_agreement", "reason")}
                for r in rows
            ],
            indent=1,
        )
    )
    return 1 if any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
