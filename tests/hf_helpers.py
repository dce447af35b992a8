"""Helpers of the Hugging Face interop tests: tiny random HF models built locally with ``transformers`` (no
download), their logits, runs of ``primus`` (through torchrun for several ranks, gloo), and each engine's own
forward pass over one of its checkpoints (in a child process: the engines patch torch for the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from primus.core.launch.env import free_port as _free_port

VOCAB = 2048
# Tiny shapes that also match the tiny-* presets (so a run of the preset can start from these weights).
SHAPES = {
    "llama": dict(rope_theta=10000.0, rms_norm_eps=1e-5),
    "qwen2": dict(rope_theta=10000.0, rms_norm_eps=1e-6),
    "qwen3": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, head_dim=64),
    "mistral": dict(rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=None),
}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


# mixture-of-experts versions of a family: HF config class and its expert fields (the tiny-qwen3-moe and
# tiny-mixtral presets' shapes)
MOE = {
    "qwen3": (
        "Qwen3MoeConfig",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
    ),
    "mistral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=176)),
}


def make_hf(
    folder: Path,
    family: str,
    *,
    tied: bool = False,
    llama3_rope: bool = False,
    moe: bool = False,
    seed: int = 0,
    vocab: int = VOCAB,
) -> Path:
    """A randomly initialised 2-layer HF model (norm weights and biases randomised too), saved to ``folder``;
    ``moe``: its mixture-of-experts version (Qwen3-MoE, Mixtral)."""
    import transformers

    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}
    kw = dict(SHAPES[family], hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4)
    if moe:
        cls[family], expert_fields = MOE[family]
        kw |= expert_fields
    kw |= dict(num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256, tie_word_embeddings=tied)
    if llama3_rope:  # long-context scaling; the original context is short so that it changes frequencies
        kw["rope_scaling"] = {**LLAMA3_ROPE, "original_max_position_embeddings": 64, "rope_theta": kw["rope_theta"]}
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls[family])(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return folder


def token_ids(batch: int = 2, seq: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def run_config(path: Path, backend: str, model: dict | None = None, **sections: dict) -> Path:
    """A fp32 CPU test config (constant LR, no clipping, no weight decay: the two engines' optimisers agree)."""
    cfg: dict = {
        "extends": ["tiny-llama"],
        "train": {
            "seq_len": 32,
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "steps": 2,
            "precision": "fp32",
            "grad_clip": 0.0,
            "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-3, "weight_decay": 0.0},
            "schedule": {"warmup_steps": 0, "decay": "constant"},
        },
        "data": {"source": "bundled", "tokenizer": "bundled"},
        "logging": {"interval": 1, "tensorboard": False, "progress": False},
        "checkpoint": {"enabled": True},
        "backend": {"name": backend},
    }
    if model is not None:
        cfg["model"] = model
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def hf_model_section(folder: Path) -> dict:
    from primus.core.hf.config import model_fields_from_hf

    return model_fields_from_hf(json.loads((folder / "config.json").read_text()), name=folder.name)


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PRIMUS_LAUNCHED", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in drop}


def run(cmd: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def primus(*args: str, nproc: int = 1, timeout: int = 240) -> subprocess.CompletedProcess:
    """``primus ARGS`` in a fresh process; with ``nproc`` > 1 each rank through torchrun (gloo)."""
    if nproc == 1:
        return run([sys.executable, "-m", "primus.core.cli.app", *args], timeout)
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1"]
    launcher += ["--master-addr=127.0.0.1", f"--master-port={_free_port()}"]
    return run([*launcher, "-m", "primus.core.cli.app", *args], timeout)


def train(config: Path, out: Path, *overrides: str, nproc: int = 1) -> list[dict]:
    """``primus train`` (its own launcher for several ranks); the metrics rows it wrote."""
    return train_logged(config, out, *overrides, nproc=nproc)[0]


def train_logged(config: Path, out: Path, *overrides: str, nproc: int = 1) -> tuple[list[dict], str]:
    """:func:`train`, and what the run printed (stdout and stderr, whitespace folded to single spaces)."""
    args = ["train", str(config), f"logging.output_dir={out}", *overrides]
    if nproc > 1:
        args += ["--nproc-per-node", str(nproc), "--master-port", str(_free_port())]
    proc = primus(*args, timeout=300)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, " ".join((proc.stdout + proc.stderr).split())


# Child-process code: the engine's model from one of its checkpoints, and its logits on ids.
_FORWARD = """
import sys, torch
from pathlib import Path

def forward(cfg, checkpoint, ids):
    with torch.no_grad():
        if cfg.backend.name == "megatron":
            from primus.megatron.hf import load_checkpoint_chunks
            engine = load_checkpoint_chunks(cfg, Path(checkpoint))
            try:
                return engine.chunks[0](ids, torch.arange(ids.shape[1]).expand_as(ids), None)
            finally:
                engine.close()
        from primus.torchtitan.hf import build_model, load_model_state
        model = build_model(cfg)
        model.load_state_dict(load_model_state(cfg, Path(checkpoint)))
        return model(ids)
"""
_CHECKPOINT_LOGITS = (
    _FORWARD
    + """
from primus.core.hf.contract import OFFLINE_OVERRIDES
from primus.core.launch.resolve import resolve
config, checkpoint, ids_path, out_path = sys.argv[1:5]
cfg = resolve(config, list(OFFLINE_OVERRIDES), world_size=1).config
torch.save(forward(cfg, checkpoint, torch.load(ids_path)), out_path)
"""
)
# import (as `primus checkpoint import` does) -> the engine's logits -> export, in one process
_ROUNDTRIP = (
    _FORWARD
    + """
from primus.core.launch.resolve import config_with_hf_model
from primus.core.hf.contract import export_checkpoint, import_checkpoint
from primus.core.run.checkpoints import readable
config, hf_dir, checkpoint, hf_out, ids_path, out_path = sys.argv[1:7]
cfg = config_with_hf_model(config, [], hf_dir)
path = import_checkpoint(cfg, hf_dir, Path(checkpoint))
torch.save(forward(cfg, path, torch.load(ids_path)), out_path)
export_checkpoint(cfg, readable(path), hf_out)
"""
)


def engine_logits(config: Path, checkpoint: Path, ids: torch.Tensor, tmp: Path) -> torch.Tensor:
    """The logits of the engine named by ``config`` (a run's config.yaml) with the weights of ``checkpoint``."""
    torch.save(ids, tmp / "ids.pt")
    run(
        [sys.executable, "-c", _CHECKPOINT_LOGITS, str(config), str(checkpoint), str(tmp / "ids.pt"), str(tmp / "l.pt")]
    )
    return torch.load(tmp / "l.pt")


def roundtrip(config: Path, hf_dir: Path, tmp: Path, ids: torch.Tensor) -> tuple[torch.Tensor, Path]:
    """Import ``hf_dir`` into the backend of ``config``, run the engine on ``ids``, export to HF again:
    (the engine's logits, the exported folder)."""
    torch.save(ids, tmp / "ids.pt")
    ckpt, out = tmp / "engine_ckpt", tmp / "exported"
    args = [str(config), str(hf_dir), str(ckpt), str(out), str(tmp / "ids.pt"), str(tmp / "l.pt")]
    run([sys.executable, "-c", _ROUNDTRIP, *args])
    return torch.load(tmp / "l.pt"), out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()
