"""Where a run's time to its first step goes, plain engines beside Primus, each case a fresh process.

    python3 benchmarks/startup.py --out DIR                  # Llama 3.2 1B, seq 4096, micro-batch 2, on one GPU
    python3 benchmarks/startup.py --out DIR --smoke          # tiny-llama, seq 64 (CPU or GPU)

Cases (``--cases``), the dense suite's (``turbo_e2e.py``) in a process each, one step:

- ``tt_plain``: plain TorchTitan 0.2.2 (``torchtitan_vs_primus.run_plain``), compiled;
- ``tt_primus``: ``primus train`` on TorchTitan, compiled, kernels ``auto`` (turbo);
- ``mg_plain``: plain megatron-core (``megatron_vs_primus.run_plain``);
- ``mg_primus``: ``primus train`` on megatron, kernels ``auto``.

Each gives ``to_first_step_s``: the process's start (``/proc``) to the end of its first step, and its parts:
``to_build_s`` (imports, config; to the engine's first model object), ``build_s`` (the model, its initial weights,
the optimizer; to the first step's start) and ``first_step_s`` (compilation, autotuning, the first kernels). Primus's
come from its run summary (core's loop records them); the plain engines' from stamps this script puts on their
``Trainer.__init__`` / ``Trainer.train`` (TorchTitan) and ``GPTModel.__init__`` / ``get_forward_backward_func``
(megatron), their step ending where ``run_plain`` returns (its tear-down, well under a second, counted in). The
``import`` column is ``python -X importtime``'s total of the modules each case imports that the other kind does not
need (``datasets``, ``pandas``, ``pyarrow``), measured in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _common import run_overrides, versions  # noqa: E402

CASES = ("tt_plain", "tt_primus", "mg_plain", "mg_primus")
SHAPE = {"gpu": ("1b", "llama3.2-1b", 4096, 2), "smoke": ("tiny", "tiny-llama", 64, 2)}
UNUSED = ("datasets", "pandas", "pyarrow")  # what a TorchTitan rank imported and never used


def process_started() -> float:
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines() if ln.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def stamp(owner: object, name: str, stamps: dict, key: str) -> None:
    """Record when ``owner.name`` is first called, in ``stamps[key]``."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        stamps.setdefault(key, time.time())
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)


def plain(case: str, smoke: bool, out: Path) -> dict:
    """A plain engine's first step in this process: the stamps as seconds from the process's start."""
    import torch

    key, _, seq, micro = SHAPE["smoke" if smoke else "gpu"]
    stamps: dict[str, float] = {}
    gpu = torch.cuda.is_available()
    if case == "tt_plain":
        from primus.torchtitan import compat

        compat.import_torchtitan()
        import torchtitan.train
        import torchtitan_vs_primus as tt

        tt.register_plain(tt.MODELS[key][1])
        stamp(torchtitan.train.Trainer, "__init__", stamps, "build")
        stamp(torchtitan.train.Trainer, "train", stamps, "step")
        tt.run_plain(1, seq, micro, out, compile_=gpu)
    else:
        import megatron.core.models.gpt as gpt
        import megatron.core.pipeline_parallel as pp
        import megatron_vs_primus as mg

        stamp(gpt.GPTModel, "__init__", stamps, "build")
        stamp(pp, "get_forward_backward_func", stamps, "step")
        args = SimpleNamespace(model=key, seq=seq, micro_batch=micro, steps=1, workdir=str(out), profile=False)
        mg.run_plain(args)
    done, started = time.time(), process_started()
    return {
        "to_build_s": round(stamps["build"] - started, 2),
        "build_s": round(stamps["step"] - stamps["build"], 2),
        "first_step_s": round(done - stamps["step"], 2),
        "to_first_step_s": round(done - started, 2),
    }


def primus_case(case: str, smoke: bool, out: Path) -> dict:
    """``primus train`` in a fresh process, one step; its summary's start-up."""
    import megatron_vs_primus as mg

    _, preset, seq, micro = SHAPE["smoke" if smoke else "gpu"]
    gpu = not smoke
    if case == "tt_primus":
        words = [
            "model.tie_word_embeddings=false",
            *run_overrides(out, seq, micro, 1),
            f"train.precision={'bf16' if gpu else 'fp32'}",
            f"train.compile={str(gpu).lower()}",
            "parallel.recompute=none",
            "backend.name=torchtitan",
        ]
    else:
        args = SimpleNamespace(seq=seq, micro_batch=micro, steps=1, gpu=gpu, kernels="auto", log_interval=1, extra=[])
        words = mg.primus_overrides(args, out)
    cmd = [sys.executable, "-m", "primus.core.cli.app", "train", preset, *words]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
    startup = json.loads((out / "summary.json").read_text())["startup"]
    return {**startup, "wall_s": round(time.time() - t0, 2), "command": "primus train " + " ".join([preset, *words])}


def imports_of_unused() -> dict:
    """``python -X importtime`` of what TorchTitan's trainer module imports: the seconds of :data:`UNUSED` among them,
    after Primus's adaptations (``compat.import_torchtitan``), which a Primus rank makes."""
    code = "from primus.torchtitan import compat; compat.import_torchtitan(); import torchtitan.train"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True)
    found = {}
    for line in proc.stderr.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2] in UNUSED:
            found[parts[2]] = round(int(parts[1]) / 1e6, 2)
    return {"unused_imports_s": found, "trainer_import_ok": proc.returncode == 0}


def child(case: str, smoke: bool, out: Path, result: Path) -> None:
    row = plain(case, smoke, out) if case.endswith("plain") else primus_case(case, smoke, out)
    result.write_text(json.dumps(row))
    os._exit(0)  # an engine's tear-down: nothing left to flush


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for startup.json")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--smoke", action="store_true", help="tiny-llama at seq 64 (CPU)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    if args.child:
        child(args.child, args.smoke, out, Path(args.result))
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), **versions(), "cases": {}}
    result |= imports_of_unused()
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            res = Path(tmp) / f"{case}.json"
            cmd = [sys.executable, __file__, "--out", str(Path(tmp) / case), "--child", case, "--result", str(res)]
            proc = subprocess.run(cmd + (["--smoke"] if args.smoke else []), capture_output=True, text=True)
            row = json.loads(res.read_text()) if res.is_file() else {"error": proc.stderr[-3000:]}
            result["cases"][case] = row
            print(case, json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
            (out / "startup.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all("error" not in r for r in result["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
