"""``train.init_from`` (a Hugging Face folder) on both engines, TP 1 and TP 2 (two gloo ranks), from one random tiny HF Llama:

- the first step's loss is ``transformers``' loss on the same batch (the weights really were loaded);
- Megatron and TorchTitan give the same loss curve (same weights, same data, fp32, constant LR, no clipping,
  no weight decay: megatron exempts norms and biases from decay, torchtitan does not). Measured: equal to
  1e-6 relative; what remains is reduction order (fused vs split QKV / gate-up GEMMs, torchtitan's
  complex-pair RoPE, megatron's fp64 grad-norm accumulation);
- TP 2 gives the TP 1 curve on each engine;
- a run started from a ``primus checkpoint import`` checkpoint trains exactly as one started from the HF folder, on both
  engines through the same key (``train.init_from`` = the imported checkpoint);
- the trained checkpoints export to HF folders whose ``transformers`` logits equal the engine's own forward.

The data order is the same on both engines by construction: both read global batch ``k`` of the same packed
samples through core's ``GlobalOrder`` (seeded by ``train.seed``, reshuffled each epoch).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_helpers import (
    engine_logits,
    hf_logits,
    hf_model_section,
    make_hf,
    max_diff,
    primus,
    run_config,
    token_ids,
    train,
)

STEPS = 4
# fp32 on CPU; measured differences between engines and layouts are <= 1e-6 relative
LOSS_RTOL = 1e-5
RUNS = {"megatron-tp1": ("megatron", 1), "torchtitan-tp1": ("torchtitan", 1)}
RUNS |= {"megatron-tp2": ("megatron", 2), "torchtitan-tp2": ("torchtitan", 2)}


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return make_hf(tmp_path_factory.mktemp("hf") / "tiny-llama-hf", "llama", seed=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf) -> dict[str, tuple[Path, list[float]]]:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, (backend, tp) in RUNS.items():
        config = run_config(root / f"{name}.yaml", backend, model=hf_model_section(hf), train={"steps": STEPS})
        rows = train(config, root / name, f"train.init_from={hf}", f"parallel.tp={tp}", nproc=tp)
        out[name] = (root / name, [r["loss"] for r in rows])
    return out


def test_first_loss_is_transformers_loss(runs, hf):
    from primus.core.launch.resolve import resolve
    from primus.megatron.data import Batches, primus_dataset

    run_dir = runs["megatron-tp1"][0]
    cfg = resolve(str(run_dir / "config.yaml"), ["train.init_from=null"]).config
    micro = Batches(primus_dataset(cfg), cfg, 0, 1, "cpu").micro_batches(0)
    tokens = torch.cat([t for t, _ in micro])
    labels = torch.cat([y for _, y in micro])
    logits = hf_logits(hf, tokens)
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()
    for name, (_, losses) in runs.items():
        assert losses[0] == pytest.approx(expected, rel=LOSS_RTOL), name


def test_megatron_and_torchtitan_same_loss_curve(runs):
    megatron, torchtitan = runs["megatron-tp1"][1], runs["torchtitan-tp1"][1]
    assert len(megatron) == len(torchtitan) == STEPS
    assert megatron[-1] < megatron[0] - 0.05  # it trains
    assert torchtitan == pytest.approx(megatron, rel=LOSS_RTOL)


@pytest.mark.parametrize("backend", ["megatron", "torchtitan"])
def test_tp2_same_loss_curve(runs, backend):
    assert runs[f"{backend}-tp2"][1] == pytest.approx(runs[f"{backend}-tp1"][1], rel=LOSS_RTOL)


@pytest.mark.parametrize("backend", ["megatron", "torchtitan"])
def test_trained_export_matches_engine(runs, hf, tmp_path, backend):
    run_dir = runs[f"{backend}-tp2"][0]
    exported = tmp_path / "exported"
    primus("checkpoint", "export", str(run_dir / "checkpoints"), "--to-hf", str(exported))
    ids = token_ids(seed=3)
    ours = engine_logits(run_dir / "config.yaml", run_dir / "checkpoints", ids, tmp_path)
    theirs = hf_logits(exported, ids)
    assert max_diff(theirs, ours) < 1e-5
    assert max_diff(theirs, hf_logits(hf, ids)) > 1e-2  # the export holds the trained weights, not the initial


@pytest.fixture(scope="module")
def imported(tmp_path_factory, hf) -> dict[str, Path]:
    """The HF folder as each engine's checkpoint (``primus checkpoint import``)."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for backend in ("megatron", "torchtitan"):
        config = run_config(root / f"{backend}.yaml", backend, model=hf_model_section(hf), train={"steps": STEPS})
        primus("checkpoint", "import", str(config), "--from-hf", str(hf), "--out", str(root / backend))
        out[backend] = root / backend
    return out


@pytest.mark.parametrize("written_by", ["megatron", "torchtitan"])
@pytest.mark.parametrize("backend", ["megatron", "torchtitan"])
def test_training_from_either_engines_checkpoint(runs, hf, imported, tmp_path, backend, written_by):
    """``train.init_from`` = a checkpoint of either engine, on either engine (the other engine's is converted to a
    HF folder first): the run trains the curve of the run started from the HF folder, first loss included (which
    test_first_loss_is_transformers_loss holds to transformers' loss)."""
    config = run_config(tmp_path / "run.yaml", backend, model=hf_model_section(hf), train={"steps": STEPS})
    rows = train(config, tmp_path / "out", f"train.init_from={imported[written_by]}")
    assert [r["loss"] for r in rows] == pytest.approx(runs[f"{backend}-tp1"][1], rel=1e-6)
    converted = list((tmp_path / "out").glob("init_from/*/config.json"))
    assert len(converted) == (written_by != backend)  # the other engine's checkpoint: converted once, beside the run


@pytest.mark.parametrize("backend", ["megatron", "torchtitan"])
def test_init_from_hf_of_another_architecture_is_refused(hf, tmp_path, backend):
    config = run_config(tmp_path / "run.yaml", backend, model={**hf_model_section(hf), "vocab_size": 4096})
    cmd = [sys.executable, "-m", "primus.core.cli.app", "train", str(config), f"logging.output_dir={tmp_path / 'out'}"]
    proc = subprocess.run([*cmd, f"train.init_from={hf}"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "model.vocab_size 4096 vs 2048" in proc.stderr


@pytest.mark.parametrize("backend", ["megatron", "torchtitan"])
def test_init_from_hf_folder_is_checked_before_the_run(tmp_path, backend):
    cmd = [
        sys.executable,
        "-m",
        "primus.core.cli.app",
        "config",
        "validate",
        str(run_config(tmp_path / "r.yaml", backend)),
    ]
    proc = subprocess.run([*cmd, f"train.init_from={tmp_path}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "train.init_from" in proc.stderr and "no config.json" in proc.stderr
