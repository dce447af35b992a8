"""``primus checkpoint import`` under a TP 2 / PP 2 layout (two gloo ranks through torchrun, each filling its own
shard through megatron's sharded state dict), then ``primus checkpoint export`` in one process (megatron's
dist_checkpointing reshards on load): the engine's forward and ``transformers`` on the export both give the
original model's logits."""

from __future__ import annotations

import json

import pytest
from hf_helpers import engine_logits, hf_logits, make_hf, max_diff, primus, run_config, token_ids

LAYOUTS = {
    "tp2-qwen3": ("qwen3", {}, "parallel.tp=2"),  # fused grouped QKV, SwiGLU fc1 halves, per-head qk-norm split by TP
    "pp2-qwen2-tied": ("qwen2", {"tied": True}, "parallel.pp=2"),  # the tied head lives on the last stage too
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_sharded_import(tmp_path, layout):
    family, opts, override = LAYOUTS[layout]
    hf = make_hf(tmp_path / "hf", family, **opts)
    ckpt, exported = tmp_path / "ckpt", tmp_path / "exported"
    config = run_config(tmp_path / "run.yaml", "megatron")
    primus("checkpoint", "import", str(config), override, "--from-hf", str(hf), "--out", str(ckpt), nproc=2)
    man = json.loads((ckpt / "manifest.json").read_text())
    assert man["layout"]["world"] == 2 and (man["layout"]["tp"], man["layout"]["pp"]) != (1, 1)

    ids = token_ids()
    ref = hf_logits(hf, ids)
    assert max_diff(engine_logits(ckpt / "config.yaml", ckpt, ids, tmp_path), ref) < 1e-5
    primus("checkpoint", "export", str(ckpt), "--to-hf", str(exported))
    assert max_diff(hf_logits(exported, ids), ref) == 0.0
