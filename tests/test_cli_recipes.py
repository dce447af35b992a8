"""The CLI as a user meets it: recipes carry their cluster and plan / validate read it, the recipe's own layout is
marked, profile runs a few steps, preflight on CPU is quick, --version, --help in a user's order without markup,
env names every Primus package, --to-hf is marked required."""

from __future__ import annotations

import json
import time

import pytest
from support import primus


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")


def test_validate_reads_the_recipes_cluster():
    run = primus("config", "validate", "llama3.1-405b-megatron-tp-pp-vpp")  # cluster 14 × 8 MI325X
    assert "world size 112" in run.stdout
    small = primus("config", "validate", "llama3.1-405b-megatron-tp-pp-vpp", "--world-size", "8", check=False)
    assert small.returncode == 2 and "does not divide the world size 8" in small.stderr


def test_plan_reads_the_recipes_cluster_and_marks_its_layout():
    run = primus("plan", "llama3.1-8b-torchtitan-fsdp")  # cluster 1 × 8 H100; FSDP 8, selective recompute
    head = " ".join(run.stdout.split())
    assert "llama3.1-8b on 1×8 H100" in head and "seq 8192" in head
    marked = [ln for ln in run.stdout.splitlines() if "(the config's)" in ln]
    assert len(marked) == 1 and "FSDP 8, selective recompute" in marked[0]
    other = primus("plan", "llama3.1-8b-torchtitan-fsdp", "--device", "H200", "--gpus", "4")  # the options still win
    assert "llama3.1-8b on 1×4 H200" in " ".join(other.stdout.split())
    preset = primus("plan", "llama3.2-1b", "--gpus", "1")  # a model preset sets no seq_len: a training length
    assert "seq 8192" in " ".join(preset.stdout.split()) and "planned at 8192" in preset.stderr


def test_version_help_env_and_required_options():
    assert primus("--version").stdout.split() == ["primus", "0.1.0"]
    help_text = primus("--help").stdout
    commands = help_text[help_text.index("Commands") :]
    names = [ln.split()[1] for ln in commands.splitlines() if ln.startswith("│ ") and len(ln.split()) > 2]
    assert names[:4] == ["train", "eval", "plan", "profile"]
    assert "``" not in help_text and "``" not in primus("profile", "--help").stdout
    assert "primus-loggers" in primus("env").stdout
    export = primus("checkpoint", "export", "--help").stdout
    assert "--to-hf" in export and "[required]" in " ".join(ln for ln in export.splitlines() if "--to-hf" in ln)


def test_preflight_on_cpu_is_quick_and_says_what_it_does():
    t0 = time.monotonic()
    run = primus("preflight")
    assert time.monotonic() - t0 < 60
    assert "preflight on CPU: GEMM 1024²" in run.stderr and "preflight: PASS" in run.stdout


def test_profile_runs_a_few_steps(tmp_path):
    primus("profile", "tiny-demo", f"logging.output_dir={tmp_path}", "logging.interval=1")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]  # wait 1 + warmup 1 + active 2 + 1, not 60
    assert (tmp_path / "profile" / "report.html").is_file()
