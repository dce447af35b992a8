"""A corpus of bad inputs, each refused with a message naming the cause, and nothing in the run folder lost.

Config-level cases go through ``primus config validate`` (in process: fast); cases that only show at run time
(files, tokenizers, datasets, devices, checkpoints) through a real ``primus train`` process. Every case
snapshots the output folder (names, sizes, mtimes) before and checks it is unchanged after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from primus.core.cli import app as cli

TT = "backend.name=torchtitan"
MG = "backend.name=megatron"

# (id, yaml added to a file that extends tiny-llama (None: no file, the preset itself), overrides,
#  world size, fragments the error must contain)
CONFIG_CASES = [
    ("broken-yaml", "train: {steps: 3\n", [], 1, ["not valid YAML"]),
    ("top-level-list", "- a\n- b\n", [], 1, ["top level must be a mapping"]),
    ("wrong-type", "train: {steps: three}", [], 1, ["train.steps", "valid integer"]),
    ("negative-size", None, ["model.hidden_size=-8"], 1, ["model.hidden_size", "greater than 0"]),
    ("unknown-key", None, ["train.stepz=3"], 1, ["train.stepz", "did you mean 'steps'"]),
    (
        "heads-vs-hidden",
        None,
        ["model.num_attention_heads=3", "model.num_kv_heads=1"],
        1,
        ["model.num_attention_heads", "does not divide"],
    ),
    ("kv-vs-heads", None, ["model.num_kv_heads=3"], 1, ["model.num_kv_heads"]),
    ("layout-not-world", None, ["parallel.tp=2", "parallel.dp_shard=2"], 2, ["parallel", "world size is 2"]),
    ("layout-not-dividing", None, ["parallel.pp=2"], 3, ["parallel", "does not divide the world size 3"]),
    ("tp-vs-heads", None, ["parallel.tp=8", "parallel.dp_shard=1"], 8, ["parallel.tp"]),
    ("pp-too-deep", None, ["parallel.pp=4"], 4, ["parallel.pp", "exceeds model.num_layers"]),
    ("vpp-without-pp", None, ["parallel.vpp=2"], 1, ["parallel.vpp"]),
    ("sp-without-tp", None, ["parallel.sequence_parallel=true"], 1, ["parallel.sequence_parallel"]),
    ("batch-not-divisible", None, ["train.global_batch_size=3"], 2, ["train.global_batch_size"]),
    ("env-var-missing", "train: {steps: '${PRIMUS_BAD_INPUT_UNSET}'}", [], 1, ["PRIMUS_BAD_INPUT_UNSET"]),
    ("extends-missing", "extends: [no-such-preset]\n", [], 1, ["no file or preset named 'no-such-preset'"]),
    ("unknown-backend", None, ["backend.name=deepspeed"], 1, ["backend.name", "deepspeed"]),
    ("unknown-kernel", None, ["kernels.attention=flashy"], 1, ["kernels.attention", "flashy"]),
    ("unknown-strategy", None, ["parallel.strategy=zero3"], 1, ["parallel.strategy"]),
    ("bad-precision", None, ["train.precision=int8"], 1, ["train.precision"]),
    ("tt-fp16", None, [TT, "train.precision=fp16"], 1, ["train.precision"]),
    ("tt-sgd", None, [TT, "train.optimizer.name=sgd"], 1, ["train.optimizer.name"]),
    (
        "tt-recompute-layers",
        None,
        [TT, "parallel.recompute=full", "parallel.recompute_layers=1"],
        1,
        ["parallel.recompute_layers"],
    ),
    (
        "tt-ddp-with-tp",
        None,
        [TT, "parallel.dp_replicate=2", "parallel.tp=2", "parallel.dp_shard=1"],
        4,
        ["parallel.dp_replicate"],
    ),
    (
        "tt-qwen3-bias",
        None,
        [TT, "model.family=qwen3", "model.qk_norm=true", "model.qkv_bias=true"],
        1,
        ["model.qkv_bias"],
    ),
    ("mg-cp-whole-sequence-attention", None, [MG, "parallel.cp=2", "kernels.attention=sdpa"], 2, ["kernels.attention"]),
    ("mg-fp16", None, [MG, "train.precision=fp16"], 1, ["train.precision"]),
    ("recipe-for-other-engine", None, ["qwen2.5-7b-megatron-ddp", TT], 8, ["parallel.distributed_optimizer"]),
]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture
def run_dir(tmp_path):
    """An output folder that already holds a finished run's files (they must survive every refusal)."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 8.0}) + "\n")
    (out / "notes.txt").write_text("keep me\n")
    return out


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_config_refusals(tmp_path, run_dir, case):
    _, body, overrides, world, fragments = case
    if overrides and not overrides[0].count("="):  # a recipe name first
        config, overrides = overrides[0], overrides[1:]
    elif body is None:
        config = "tiny-llama"
    else:
        config = str(tmp_path / "exp.yaml")
        head = (
            ""
            if body.startswith("extends") or body.startswith("-") or "{steps: 3\n" in body
            else "extends: [tiny-llama]\n"
        )
        Path(config).write_text(head + textwrap.dedent(body))
    before = _snapshot(run_dir)
    res = CliRunner().invoke(
        cli.app, ["config", "validate", config, *overrides, f"logging.output_dir={run_dir}", "--world-size", str(world)]
    )
    assert res.exit_code == 2, res.output
    for fragment in fragments:
        assert fragment in res.output, f"{fragment!r} not in:\n{res.output}"
    assert _snapshot(run_dir) == before


def _write_tiny_jsonl(path: Path, n: int = 40) -> Path:
    path.write_text("".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(n)))
    return path


def _runtime_cases(tmp: Path) -> list[tuple[str, list[str], list[str]]]:
    good = _write_tiny_jsonl(tmp / "good.jsonl")
    (tmp / "broken_tok").mkdir()
    (tmp / "broken_tok" / "tokenizer.json").write_text("{ not json")
    (tmp / "nokey.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    (tmp / "badline.jsonl").write_text(json.dumps({"text": "ok"}) + "\n{oops\n")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "data.csv").write_text("a,b\n")
    (tmp / "only.bin").write_bytes(b"\x00" * 64)
    (tmp / "bad.bin").write_bytes(b"\x00" * 64)
    (tmp / "bad.idx").write_bytes(b"NOTMMIDIDX" + b"\x00" * 30)
    return [
        ("missing-data-file", [f"data.source={tmp / 'nope.jsonl'}"], ["data.source", "nope.jsonl"]),
        ("missing-tokenizer", [f"data.source={good}", f"data.tokenizer={tmp / 'no_tok'}"], ["no_tok"]),
        ("corrupt-tokenizer", [f"data.source={good}", f"data.tokenizer={tmp / 'broken_tok'}"], ["broken_tok"]),
        ("vocab-too-small", ["model.vocab_size=100"], ["vocab_size"]),
        ("jsonl-missing-key", [f"data.source={tmp / 'nokey.jsonl'}"], ["nokey.jsonl", "text"]),
        ("jsonl-broken-line", [f"data.source={tmp / 'badline.jsonl'}"], ["badline.jsonl:2"]),
        ("empty-dataset", [f"data.source={tmp / 'empty.jsonl'}"], ["empty.jsonl"]),
        ("unknown-format", [f"data.source={tmp / 'data.csv'}"], ["data.csv"]),
        ("bin-without-idx", [f"data.source={tmp / 'only.bin'}"], ["only"]),
        ("corrupt-idx", [f"data.source={tmp / 'bad.bin'}"], ["bad.idx"]),
        ("kernel-unavailable-on-cpu", ["kernels.attention=cudnn"], ["kernels.attention", "cudnn", "no CUDA device"]),
        ("triton-kernel-on-cpu", ["kernels.rms_norm=triton"], ["kernels.rms_norm", "triton"]),
    ]


RUNTIME_IDS = [
    "missing-data-file",
    "missing-tokenizer",
    "corrupt-tokenizer",
    "vocab-too-small",
    "jsonl-missing-key",
    "jsonl-broken-line",
    "empty-dataset",
    "unknown-format",
    "bin-without-idx",
    "corrupt-idx",
    "kernel-unavailable-on-cpu",
    "triton-kernel-on-cpu",
]


def _train(tmp_path: Path, out: Path, *overrides: str, resume: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PRIMUS_CACHE=str(tmp_path / "cache"))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "primus.core.cli.app",
            "train",
            "tiny-llama",
            "train.steps=2",
            "train.seq_len=32",
            "train.precision=fp32",
            *overrides,
            f"logging.output_dir={out}",
            "logging.tensorboard=false",
            "checkpoint.enabled=false",
            *(["--resume"] if resume else []),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _assert_one_line_error(proc: subprocess.CompletedProcess[str], fragments: list[str]) -> None:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert any(ln.startswith("error:") for ln in text.splitlines()), f"no one-line error:\n{text[-3000:]}"
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in:\n{text[-3000:]}"
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("backend", ["torchtitan", "megatron"])
@pytest.mark.parametrize("name", RUNTIME_IDS)
def test_runtime_refusals(tmp_path, backend, name):
    overrides, fragments = next((o, f) for n, o, f in _runtime_cases(tmp_path) if n == name)
    out = tmp_path / "fresh"
    _assert_one_line_error(_train(tmp_path, out, f"backend.name={backend}", *overrides), fragments)
    # refused before any training: no checkpoint and no metrics were written
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("backend", ["torchtitan", "megatron"])
def test_an_earlier_run_is_never_overwritten(tmp_path, run_dir, backend):
    before = _snapshot(run_dir)
    proc = _train(tmp_path, run_dir, f"backend.name={backend}")
    _assert_one_line_error(proc, ["holds an earlier run", "metrics.jsonl", "--resume"])
    assert _snapshot(run_dir) == before


def test_the_corpus_is_large_enough():
    assert len(CONFIG_CASES) + 2 * len(RUNTIME_IDS) >= 40
